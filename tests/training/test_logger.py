"""RunLogger: JSON lines and wandb on rank 0 only, offline wandb under run_dir, no network; per-rank console logs."""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.training.logger import RunLogger, setup_console_logging
from physics_dp.training.plots import plot_spectra

from .wandb_records import history_rows


@pytest.fixture
def quiet_wandb(tmp_path, monkeypatch):
    """wandb silent, its caches under tmp, and any attempt to reach a server refused at once."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _read_lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_disabled_mode_writes_json_lines(tmp_path, quiet_wandb):
    run_dir = tmp_path / "run"
    with RunLogger(run_dir, mode="disabled", project="p", config={"lr": 1e-3}, rank=0) as logger:
        logger.log({"loss": 0.5, "epoch": 1, "lr": torch.tensor(1e-3)}, step=0)
        logger.log({"loss": torch.tensor([0.25])}, step=10)
        image = plot_spectra({"a": torch.randn(8, 8)}, tmp_path / "spectra.png")
        logger.log_image("spectra", image, step=10)
        with pytest.raises(FileNotFoundError, match="missing.png"):
            logger.log_image("missing", tmp_path / "missing.png", step=10)
    assert not logger.active
    lines = _read_lines(run_dir / "metrics.jsonl")
    assert lines == [{"step": 0, "loss": 0.5, "epoch": 1, "lr": pytest.approx(1e-3)}, {"step": 10, "loss": 0.25}]
    assert not (run_dir / "wandb").exists()
    logger.close()  # twice is fine


def test_resumed_run_appends(tmp_path, quiet_wandb):
    for step in (0, 1):
        with RunLogger(tmp_path, mode="disabled", project="p", rank=0) as logger:
            logger.log({"loss": float(step)}, step=step)
    assert [line["step"] for line in _read_lines(tmp_path / "metrics.jsonl")] == [0, 1]


def test_rejects_non_scalars_and_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="unknown wandb mode 'offlne'"):
        RunLogger(tmp_path, mode="offlne", project="p", rank=0)
    with RunLogger(tmp_path, mode="disabled", project="p", rank=0) as logger:
        with pytest.raises(ValueError, match="'field' must be a scalar"):
            logger.log({"field": torch.zeros(3)}, step=0)
        with pytest.raises(TypeError, match="'name' must be an int, float"):
            logger.log({"name": "x"}, step=0)
        with pytest.raises(TypeError, match="'flag' must be an int, float"):
            logger.log({"flag": True}, step=0)


def test_other_ranks_do_nothing(tmp_path, quiet_wandb):
    run_dir = tmp_path / "run"
    logger = RunLogger(run_dir, mode="offline", project="p", rank=1)
    logger.log({"loss": 1.0}, step=0)
    logger.log_image("missing", tmp_path / "missing.png", step=0)
    bar = logger.progress(100)
    assert bar.disable
    bar.close()
    logger.close()
    assert not run_dir.exists()


def test_progress_bar_on_rank_zero(tmp_path):
    with RunLogger(tmp_path, mode="disabled", project="p", rank=0) as logger:
        bar = logger.progress(50, initial=10)
        assert not bar.disable and bar.total == 50 and bar.n == 10 and bar.mininterval == 1.0
        bar.update(5)
        assert bar.n == 15
        bar.close()


@pytest.mark.timeout(120)
def test_offline_wandb_writes_under_run_dir(tmp_path, quiet_wandb):
    run_dir = tmp_path / "run"
    image = plot_spectra({"a": torch.randn(8, 8)}, tmp_path / "spectra.png")
    options = dict(project="physics-dp-test", name="t", tags=("ci",), config={"lr": 0.1})
    with RunLogger(run_dir, mode="offline", rank=0, **options) as logger:
        for step in range(3):
            logger.log({"loss": 1.0 / (step + 1)}, step=step)
        logger.log_image("spectra", image, step=2)
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), "the offline run holds no .wandb log"
    assert len(_read_lines(run_dir / "metrics.jsonl")) == 3


@pytest.mark.timeout(120)
def test_stages_counting_from_one_keep_every_wandb_point(tmp_path, quiet_wandb):
    """Two stages, each logging steps 1..3 into one offline run: wandb keeps all six rows, each with
    its stage's own step, and the figures as images at their steps."""
    image = plot_spectra({"a": torch.randn(8, 8)}, tmp_path / "spectra.png")
    with RunLogger(tmp_path, mode="offline", project="p", rank=0) as logger:
        for stage in ("regression", "diffusion"):
            for step in (1, 2, 3):
                logger.log({f"{stage}/loss": 10.0 * step, f"{stage}/lr": 0.1}, step=step)
            logger.log_image(f"{stage}/spectra", image, step=3)
        logger.log({"epoch": 1}, step=7)
    rows = history_rows(tmp_path)
    for stage in ("regression", "diffusion"):
        points = [(row[f"{stage}/step"], row[f"{stage}/loss"]) for row in rows if f"{stage}/loss" in row]
        assert points == [(1, 10.0), (2, 20.0), (3, 30.0)], stage
        images = [row for row in rows if f"{stage}/spectra/_type" in row]  # an image's fields are nested keys
        assert len(images) == 1 and images[0][f"{stage}/step"] == 3 and images[0][f"{stage}/spectra/_type"] == "image-file"
    assert [row["step"] for row in rows if "epoch" in row] == [7]
    assert [row["_step"] for row in rows] == list(range(len(rows)))  # wandb's own step only increases


def _log_sharded_metric(run_dir: str) -> tuple[str, str]:
    """Rank 0 logs a replicated ShardTensor scalar; a still-sharded one is refused on every rank."""
    mesh = get_mesh((2,), ("domain",))
    field = distribute_tensor(torch.arange(10.0).reshape(1, 10), mesh, [Shard(1)])
    logger = RunLogger(run_dir, mode="disabled", project="p", rank=dist.get_rank())
    logger.log({"mean": field.mean()}, step=3)
    try:
        logger.log({"field": field}, step=4)
    except TypeError as error:
        refused = str(error)
    else:
        refused = "accepted"
    logger.close()
    return type(field.mean()).__name__, refused


def test_sharded_metrics_on_two_ranks():
    with tempfile.TemporaryDirectory() as run_dir:
        results = run_on_ranks(2, _log_sharded_metric, run_dir)
        lines = _read_lines(os.path.join(run_dir, "metrics.jsonl"))
    assert lines == [{"step": 3, "mean": 4.5}]
    for kind, refused in results:
        assert kind == "ShardTensor"
        assert "reduce it to a replicated value" in refused


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("rank, shows_info", [(0, True), (3, False)])
def test_console_logging_per_rank(rank, shows_info, restore_root_logger):
    first = io.StringIO()
    setup_console_logging(rank, stream=first)
    stream = io.StringIO()
    setup_console_logging(rank, stream=stream)  # replaces the first handler instead of adding one
    log = logging.getLogger("physics_dp.test")
    log.info("info line")
    log.warning("warning line")
    lines = stream.getvalue().splitlines()
    assert first.getvalue() == ""
    assert all(line.startswith(f"[rank {rank}] ") for line in lines)
    assert any("WARNING physics_dp.test: warning line" in line for line in lines)
    assert any("info line" in line for line in lines) == shows_info
