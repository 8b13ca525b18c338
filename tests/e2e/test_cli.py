"""The real command lines: ``torchrun ... -m physics_dp.train`` and ``python -m physics_dp.train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.training.wandb_records import history_rows

SMALL = [
    "data.synthetic.n_times=12",
    "data.synthetic.height=16",
    "data.synthetic.width=24",
    "data.train_times=[0,9]",
    "data.valid_times=[9,12]",
    "sampling.num_steps=2",
    "logging.wandb_mode=offline",
]


def _run(args: list[str], tmp_path: Path, timeout: float = 240.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PHYSICS_DP_CACHE": str(tmp_path / "cache")}
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "physics_dp.train"]


def test_torchrun_stormcast_two_stages(tmp_path):
    proc = _run(
        _torchrun(2) + ["+experiment=stormcast", "parallel.domain_size=2", "training.max_steps=4", "training.checkpoint_interval=2",
                        "training.validation_interval=2", "training.log_interval=1", f"run.dir={tmp_path}/run", *SMALL],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for stage in ("regression", "diffusion"):
        assert any(f"{stage}/loss" in line for line in lines), stage
        assert (run / stage / "checkpoints" / "step_000004").is_dir() and (run / stage / "model.pt").is_file()
        assert list((run / stage / "figures").glob("prediction_*.png"))
    # The offline wandb run under the run directory holds every point of both stages, each stage's
    # steps counting from 1, and the figures as images at their steps.
    rows = history_rows(run)
    logged = {(line["step"], key, value) for line in lines for key, value in line.items() if key != "step"}
    kept = {(row[f"{key.split('/')[0]}/step"], key, value) for row in rows for key, value in row.items()
            if "/" in key and not key.endswith("/step") and "/prediction/" not in key and "/spectra/" not in key}
    assert logged == kept and {step for step, key, _ in logged if key == "diffusion/loss"} == {1, 2, 3, 4}
    images = {(row[f"{stage}/step"], stage) for row in rows for stage in ("regression", "diffusion") if f"{stage}/prediction/_type" in row}
    assert images == {(step, stage) for step in (2, 4) for stage in ("regression", "diffusion")}
    assert "parallel" in (run / "config.yaml").read_text()
    # Inference from the run: a domain-parallel rollout with two members, as CF netCDF.
    proc = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "physics_dp.infer",
         f"run_dir={run}", "steps=2", "members=2", f"out={tmp_path}/forecast"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import xarray

    with xarray.open_dataset(tmp_path / "forecast" / "forecast.nc") as forecast:
        assert dict(forecast.sizes) == {"time": 2, "ensemble": 2, "y": 16, "x": 24}
        assert forecast["t2m"].attrs["units"] and forecast["time"].dtype.kind == "M"
    assert (tmp_path / "forecast" / "scores.json").is_file()


def test_python_m_diffusion_with_dit(tmp_path):
    proc = _run(
        [sys.executable, "-m", "physics_dp.train", "+experiment=diffusion", "model.diffusion.architecture=dit", "training.max_steps=2",
         "logging.wandb_mode=disabled", "run.name=dit"] + SMALL[:-1],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = (tmp_path / "outputs" / "dit").iterdir()  # <output_root>/<name>/<timestamp>
    assert (run / "diffusion" / "model.pt").is_file()


def test_mistyped_key_exits_nonzero_naming_it(tmp_path):
    proc = _run([sys.executable, "-m", "physics_dp.train", "+experiment=stormcast", "training.max_stpes=3"], tmp_path, timeout=120.0)
    assert proc.returncode != 0 and "max_stpes" in proc.stderr


def test_domain_size_not_dividing_world_fails_on_every_rank(tmp_path):
    proc = _run(_torchrun(2) + ["+experiment=stormcast", "parallel.domain_size=3", f"run.dir={tmp_path}/run", *SMALL], tmp_path, timeout=180.0)
    assert proc.returncode != 0
    # Both ranks print the same error (Hydra reports each rank's exception) and exit non-zero.
    assert proc.stderr.count("parallel.domain_size=3 does not divide the world size 2") >= 2
