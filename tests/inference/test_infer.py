"""Inference from a tiny trained run: 1 rank, 2 domain ranks and 2 data ranks agree; the netCDF is
CF (xarray decodes it), values are the models' own forecasts in physical units, scores and figures
are written, bad requests fail with a message, and the torchrun CLI works."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import netCDF4
import numpy as np
import pytest
import torch
import xarray as xr

from physics_dp.config import compose_config
from physics_dp.testing import run_on_ranks

SMALL = ["data.synthetic.n_times=16", "data.synthetic.height=32", "data.synthetic.width=48", "data.train_times=[0,12]", "data.valid_times=[12,16]"]
FORECAST = ["steps=2", "members=2", "sampling.num_steps=2", "seed=3"]
TOL = 1e-4


def _train(tmp: str, experiment: str, *extra: str) -> None:
    from physics_dp.training.run import train

    overrides = [
        f"+experiment={experiment}",
        "logging.wandb_mode=disabled",
        "logging.figures=false",
        "schedule=constant",
        f"data.root={tmp}/data",
        f"run.dir={tmp}/run",
        "training.max_steps=1",
        "training.global_batch_size=2",
        "training.validation_batches=1",
        "sampling.num_steps=2",
        "parallel.domain_size=2",
        *SMALL,
        *extra,
    ]
    train(compose_config(overrides))


def _infer(tokens: list[str]) -> dict:
    from physics_dp.infer import infer
    from physics_dp.inference import parse_args

    result = infer(*parse_args(tokens))
    return {"scores": result.scores, "forecast": str(result.forecast), "figures": [str(p) for p in result.figures]}


def _error(tokens: list[str]) -> str:
    try:
        _infer(tokens)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.fixture(scope="module")
def stormcast_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("stormcast")
    run_on_ranks(2, _train, str(tmp), "stormcast", "training.stage=both", timeout=300.0)
    return tmp / "run"


@pytest.fixture(scope="module")
def forecasts(stormcast_run, tmp_path_factory) -> dict[str, dict]:
    """The same ensemble forecast on 1 rank, 2 domain ranks, and 2 data ranks (members split)."""
    out = tmp_path_factory.mktemp("forecasts")
    layouts = {"single": (1, ["figures=false"]), "domain": (2, []), "data": (2, ["domain_size=1", "figures=false"])}
    results = {}
    for name, (world, extra) in layouts.items():
        tokens = [f"run_dir={stormcast_run}", f"out={out / name}", *FORECAST, *extra]
        per_rank = run_on_ranks(world, _infer, tokens, timeout=120.0)
        assert all(r["scores"] == per_rank[0]["scores"] for r in per_rank)  # every rank returns the scores
        results[name] = per_rank[0]
    return results


def _fields(path: str) -> dict[str, np.ndarray]:
    with xr.open_dataset(path) as ds:
        return {name: ds[name].values for name in ("u10m", "v10m", "t2m")}


def test_layouts_agree_with_one_process(forecasts):
    single = _fields(forecasts["single"]["forecast"])
    for layout in ("domain", "data"):
        other = _fields(forecasts[layout]["forecast"])
        for name, values in single.items():
            assert np.abs(other[name] - values).max() < TOL * max(1.0, np.abs(values).max()), (layout, name)
        for metric in ("rmse", "spread", "crps"):
            for name, values in forecasts["single"]["scores"][metric].items():
                np.testing.assert_allclose(forecasts[layout]["scores"][metric][name], values, rtol=TOL, atol=TOL)


def test_netcdf_is_cf_with_source_metadata(forecasts, stormcast_run):
    data = stormcast_run.parent / "data"
    with xr.open_dataset(forecasts["domain"]["forecast"]) as ds, netCDF4.Dataset(data / "state_001.nc") as src:
        assert dict(ds["t2m"].sizes) == {"time": 2, "ensemble": 2, "y": 32, "x": 48}
        assert np.issubdtype(ds["time"].dtype, np.datetime64)
        # state_001.nc holds time indices 8..15; the validation split starts at 12
        dates = netCDF4.num2date(src["time"][:], src["time"].units, only_use_cftime_datetimes=False)
        np.testing.assert_array_equal(ds["time"].values, np.array([np.datetime64(dates[i], "ns") for i in (5, 6)]))
        assert ds["forecast_reference_time"].values == np.datetime64(dates[4], "ns")
        np.testing.assert_array_equal(ds["y"].values, src["y"][:])
        np.testing.assert_array_equal(ds["x"].values, src["x"][:])
        for name in ("u10m", "v10m", "t2m"):
            assert ds[name].attrs["units"] == src[name].units
            assert ds[name].attrs["long_name"] == src[name].long_name
            assert np.isfinite(ds[name].values).all()
        assert not np.array_equal(ds["t2m"].values[:, 0], ds["t2m"].values[:, 1])  # members differ


def test_scores_and_figures_written(forecasts):
    out = Path(forecasts["domain"]["forecast"]).parent
    scores = json.loads((out / "scores.json").read_text())
    assert scores["lead_steps"] == [1, 2] and scores["members"] == 2
    for metric in ("rmse", "spread", "crps"):
        assert set(scores[metric]) == {"u10m", "v10m", "t2m"}
        assert all(math.isfinite(v) and v > 0 for values in scores[metric].values() for v in values)
    assert [Path(p).name for p in forecasts["domain"]["figures"]] == ["step_001.png", "step_002.png"]
    assert all((out / "figures" / name).stat().st_size > 10_000 for name in ("step_001.png", "step_002.png"))


def _by_hand(run_dir: str, out: str) -> float:
    """Roll the regression model out by hand on plain tensors; the largest difference to the file."""
    from omegaconf import OmegaConf

    from physics_dp.data import WeatherDataset
    from physics_dp.data.stats import load_or_compute_stats
    from physics_dp.recipes import Channels
    from physics_dp.recipes.stormcast import build_regression_model
    from physics_dp.training.data_setup import data_spec

    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    spec = data_spec(cfg.data)
    stats = load_or_compute_stats(spec)
    dataset = WeatherDataset(spec, "valid", stats=stats)
    model = build_regression_model(cfg.model, Channels.from_names(dataset.channel_names), dataset.grid_shape)
    model.load_state_dict(torch.load(Path(run_dir) / "regression" / "model.pt", weights_only=True))
    mean = torch.tensor(stats.groups["state"].mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(stats.groups["state"].std, dtype=torch.float32).view(-1, 1, 1)
    state = dataset[0]["state"][None]
    written = _fields(out)
    worst = 0.0
    with torch.no_grad():
        for step in range(3):
            sample = dataset[step]
            state = model(state, torch.cat([sample["background"], sample["invariants"]])[None])
            physical = (state[0] * std + mean).numpy()
            for c, name in enumerate(("u10m", "v10m", "t2m")):
                worst = max(worst, float(np.abs(written[name][step] - physical[c]).max()))
    dataset.close()
    return worst


def test_regression_only_rollout_is_the_model_fed_its_own_forecast(stormcast_run, tmp_path):
    """Without a diffusion model the rollout is deterministic, has no ensemble dim, and step k + 1
    is the regression model applied to step k's forecast (in physical units in the file)."""
    run = tmp_path / "regression_run"
    run.mkdir()
    shutil.copy(stormcast_run / "config.yaml", run / "config.yaml")
    shutil.copytree(stormcast_run / "regression", run / "regression")
    out = tmp_path / "out"
    run_on_ranks(2, _infer, [f"run_dir={run}", f"out={out}", "steps=3", "figures=false"], timeout=120.0)
    with xr.open_dataset(out / "forecast.nc") as ds:
        assert dict(ds["u10m"].sizes) == {"time": 3, "y": 32, "x": 48}
    assert run_on_ranks(1, _by_hand, str(run), str(out / "forecast.nc"))[0] < 1e-3
    assert not list(out.glob("figures/*.png"))
    message = run_on_ranks(2, _error, [f"run_dir={run}", f"out={tmp_path / 'x'}", "members=2"])[0]
    assert "no diffusion model" in message and "members=1" in message


def test_bad_requests_name_the_problem(stormcast_run, tmp_path):
    from physics_dp.inference import parse_args

    with pytest.raises(ValueError, match="unknown option 'step'"):
        parse_args([f"run_dir={stormcast_run}", "step=2"])
    with pytest.raises(ValueError, match="not key=value"):
        parse_args([str(stormcast_run)])
    with pytest.raises(ValueError, match="run_dir=PATH is required"):
        parse_args(["steps=2"])
    too_long = run_on_ranks(2, _error, [f"run_dir={stormcast_run}", f"out={tmp_path}", "steps=3", "start_time=1"])[0]
    assert "needs validation sample 3" in too_long and "has 3 samples" in too_long
    not_a_run = run_on_ranks(1, _error, [f"run_dir={tmp_path}"])[0]
    assert "config.yaml does not exist" in not_a_run
    uneven = run_on_ranks(2, _error, [f"run_dir={stormcast_run}", "members=3", "domain_size=1", f"out={tmp_path}"])[0]
    assert "members=3 does not divide over the 2 data-parallel ranks" in uneven
    assert not (tmp_path / "forecast.nc").exists() and not list(tmp_path.glob("*.partial"))
    # Rank 0 cannot open its output: every rank raises instead of waiting in the rollout.
    blocked = tmp_path / "blocked"
    (blocked / "forecast.nc.partial").mkdir(parents=True)
    for message in run_on_ranks(2, _error, [f"run_dir={stormcast_run}", f"out={blocked}", "steps=1"], timeout=120.0):
        assert "forecast.nc" in message, message


def test_torchrun_cli(stormcast_run, forecasts, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "physics_dp.infer",
        f"run_dir={stormcast_run}", f"out={tmp_path}", "steps=1", "members=2", "sampling.num_steps=2", "seed=3", "figures=false",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rmse t2m" in done.stdout and "crps u10m" in done.stdout and "wrote" in done.stdout
    expected = _fields(forecasts["single"]["forecast"])
    for name, values in _fields(str(tmp_path / "forecast.nc")).items():
        assert np.abs(values - expected[name][:1]).max() < TOL * np.abs(expected[name]).max()  # its one step


def _diffusion_run(run: str, data_root: str) -> None:
    """A diffusion-recipe run directory holding a DiT with seeded random weights: inference needs
    only the config and the exported weights, not how good they are. (The noise lifts the
    adaLN-Zero initialisation, whose zero output layer would bypass the network.)"""
    from omegaconf import OmegaConf

    from physics_dp.data import WeatherDataset
    from physics_dp.recipes import Channels, DiffusionTask
    from physics_dp.training.data_setup import data_spec

    cfg = compose_config(["+experiment=diffusion", "model.diffusion.architecture=dit", f"data.root={data_root}", *SMALL])
    dataset = WeatherDataset(data_spec(cfg.data), "valid", normalize=False)
    torch.manual_seed(0)
    model = DiffusionTask(cfg.model, Channels.from_names(dataset.channel_names), dataset.grid_shape, cfg.sampling).build_model()
    dataset.close()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    (Path(run) / "diffusion").mkdir(parents=True)
    (Path(run) / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    torch.save(model.state_dict(), Path(run) / "diffusion" / "model.pt")


def test_diffusion_recipe_samples_each_time_on_any_layout(stormcast_run, tmp_path):
    run = tmp_path / "run"
    run_on_ranks(1, _diffusion_run, str(run), str(stormcast_run.parent / "data"))
    tokens = [f"run_dir={run}", "steps=2", "members=2", "sampling.num_steps=2", "figures=false"]
    single = run_on_ranks(1, _infer, [*tokens, f"out={tmp_path / 'a'}"], timeout=120.0)[0]
    sharded = run_on_ranks(2, _infer, [*tokens, f"out={tmp_path / 'b'}"], timeout=120.0)[0]
    a, b = _fields(single["forecast"]), _fields(sharded["forecast"])
    for name in a:
        assert np.abs(a[name] - b[name]).max() < TOL * np.abs(a[name]).max(), name
    with xr.open_dataset(sharded["forecast"]) as ds:
        assert dict(ds["v10m"].sizes) == {"time": 2, "ensemble": 2, "y": 32, "x": 48}
        assert (np.diff(ds["time"].values) == np.timedelta64(1, "h")).all()
    assert all(math.isfinite(v) for values in sharded["scores"]["crps"].values() for v in values)


def _infer_recording_layouts(tokens: list[str]) -> dict:
    from physics_dp.inference import rollout

    layouts = set()
    wrap = rollout.shard_batch

    def recording(*args, **kwargs):
        batch = wrap(*args, **kwargs)
        layouts.add(batch["state"].to_local().is_contiguous(memory_format=torch.channels_last))
        return batch

    rollout.shard_batch = recording
    try:
        return {**_infer(tokens), "channels_last": layouts}
    finally:
        rollout.shard_batch = wrap


def test_channels_last_inference_equals_row_major(stormcast_run, forecasts, tmp_path):
    """training.channels_last=true (the run's or given at inference) lays the fields out channels
    last, as the trainer does, and forecasts what row-major inference does."""
    tokens = [f"run_dir={stormcast_run}", f"out={tmp_path}", *FORECAST, "training.channels_last=true"]
    per_rank = run_on_ranks(2, _infer_recording_layouts, tokens, timeout=300.0)
    assert all(r["channels_last"] == {True} for r in per_rank)
    row_major = _fields(forecasts["domain"]["forecast"])
    for name, values in _fields(per_rank[0]["forecast"]).items():
        assert np.abs(values - row_major[name]).max() < TOL * max(1.0, np.abs(row_major[name]).max()), name


def _infer_counting_graphs(tokens: list[str]) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    result = _infer(tokens)
    return {**result, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


def test_compiled_inference_equals_eager(stormcast_run, forecasts, tmp_path):
    """training.compile=true (given at inference) compiles the models and forecasts what eager does."""
    tokens = [f"run_dir={stormcast_run}", f"out={tmp_path}", *FORECAST, "training.compile=true", "training.compile_backend=aot_eager"]
    per_rank = run_on_ranks(2, _infer_counting_graphs, tokens, timeout=300.0)
    assert all(r["graphs"] >= 2 for r in per_rank), per_rank  # regression and diffusion models
    eager = _fields(forecasts["domain"]["forecast"])
    compiled = _fields(per_rank[0]["forecast"])
    for name, values in eager.items():
        assert np.abs(compiled[name] - values).max() < TOL * max(1.0, np.abs(values).max()), name
