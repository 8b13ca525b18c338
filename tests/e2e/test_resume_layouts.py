"""A StormCast run stopped on one layout resumes on another with bitwise the saved model and
optimizer state (FSDP data 2 -> domain 2 -> DDP 2x2 -> one process)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from physics_dp.config import compose_config
from physics_dp.testing import get_mesh, run_on_ranks

from .test_stormcast_matrix import TINY, _run

FULL = StateDictOptions(full_state_dict=True)  # every rank gets the full tensors


def _flatten(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, (list, tuple)):
            value = dict(enumerate(value))
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value.detach().clone()
        elif isinstance(value, (bool, int, float)):
            flat[name] = torch.tensor(value)
    return flat


def _loaded_state(overrides: list[str], layout: tuple[int, int], data_parallel: str) -> dict[str, torch.Tensor]:
    """Build the regression stage on ``layout``, load the run's latest checkpoint, return the full
    model and optimizer state (collective)."""
    from physics_dp.nn import parallelize
    from physics_dp.recipes import Channels, RegressionTask
    from physics_dp.training.checkpoint import Checkpointer
    from physics_dp.training.data_setup import data_spec
    from physics_dp.data import WeatherDataset
    from physics_dp.training.optim import build_optimizer, build_scheduler

    cfg = compose_config(overrides)
    mesh = get_mesh(layout, ("data", "domain"))
    dataset = WeatherDataset(data_spec(cfg.data), "train", rows=(0, 1), normalize=False)
    task = RegressionTask(cfg.model, Channels.from_names(dataset.channel_names), dataset.grid_shape)
    dataset.close()
    parallel = parallelize(task.build_model(), mesh, data_parallel)
    optimizer = build_optimizer(cfg.optim, parallel.model.parameters())
    scheduler = build_scheduler(cfg.schedule, optimizer, cfg.training.max_steps)
    loaded = Checkpointer(f"{cfg.run.dir}/regression/checkpoints").load(parallel.model, optimizer, scheduler)
    model_state, optim_state = get_state_dict(parallel.model, optimizer, options=FULL)
    return {"step": torch.tensor(loaded["step"]), **_flatten(model_state, "model."), **_flatten(optim_state, "optim.")}


def test_resume_on_other_layouts_is_bitwise(tmp_path):
    overrides = ["+experiment=stormcast", *TINY, "training.stage=regression", f"data.root={tmp_path}/data", f"run.dir={tmp_path}/run",
                 "logging.figures=false", "training.max_steps=2", "parallel.data_parallel=fsdp"]
    run_on_ranks(2, _run, overrides + ["parallel.domain_size=1"], timeout=300.0)  # trained on 2 data ranks
    saved = run_on_ranks(2, _loaded_state, overrides, (2, 1), "fsdp", timeout=300.0)[0]
    assert saved["step"].item() == 2 and any(k.startswith("optim.state.") for k in saved)
    for layout, data_parallel in [((1, 2), "fsdp"), ((2, 2), "ddp"), ((1, 1), "none")]:
        world = layout[0] * layout[1]
        for rank, state in enumerate(run_on_ranks(world, _loaded_state, overrides, layout, data_parallel, timeout=300.0)):
            assert state.keys() == saved.keys()
            for key, value in state.items():
                assert torch.equal(value, saved[key]), f"{layout} {data_parallel} rank {rank}: {key} differs"
