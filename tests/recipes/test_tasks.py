"""Recipe tasks: losses on sharded batches equal one device (masked, channel-weighted), and the
StormCast diffusion stage is conditioned on state, regression mean, background and invariants."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from physics_dp.config import ModelConfig, SamplingConfig
from physics_dp.recipes import Channels, RegressionTask, ResidualDiffusionTask
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.training.task import masked_mean

CHANNELS = Channels(state=2, background=2, invariants=1)
GRID = (11, 8)


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 2, *GRID, generator=gen) > 0.2
    return {
        "state": torch.randn(2, 2, *GRID, generator=gen),
        "target": torch.randn(2, 2, *GRID, generator=gen),
        "background": torch.randn(2, 2, *GRID, generator=gen),
        "invariants": torch.randn(2, 1, *GRID, generator=gen),
        "mask": mask,
    }


def _model_cfg():
    return OmegaConf.structured(ModelConfig)


def _losses(world: int) -> tuple[float, float, float, float]:
    mesh = get_mesh((world,), ("domain",))
    batch = _batch()
    sharded = {k: distribute_tensor(v, mesh, [Shard(2)]) for k, v in batch.items()}
    error = (batch["state"] - batch["target"]) ** 2
    shard_error = (sharded["state"] - sharded["target"]) ** 2
    weights = [2.0, 0.5]
    torch.manual_seed(0)
    task = RegressionTask(_model_cfg(), CHANNELS, GRID, weights)
    model = task.build_model()
    return (
        masked_mean(shard_error, sharded["mask"], weights).item(),
        masked_mean(error, batch["mask"], weights).item(),
        task.loss(model, sharded, seed=0, sample_ids=torch.arange(2)).item(),
        task.loss(model, batch, seed=0, sample_ids=torch.arange(2)).item(),
    )


def test_masked_weighted_losses_match_single_device():
    for world in (2, 3):
        for sharded_mean, single_mean, sharded_loss, single_loss in run_on_ranks(world, _losses, world, timeout=120.0):
            assert abs(sharded_mean - single_mean) < 1e-6
            assert abs(sharded_loss - single_loss) < 1e-5


def test_masked_mean_counts_only_valid_points():
    error = torch.ones(1, 2, 2, 2)
    mask = torch.zeros(1, 2, 2, 2, dtype=torch.bool)
    mask[0, 0, 0, 0] = True
    assert masked_mean(error * 3, mask).item() == 3.0
    assert masked_mean(error, mask, [0.5, 9.0]).item() == 0.5
    assert masked_mean(error, torch.zeros_like(mask)).item() == 0.0


def test_residual_diffusion_is_conditioned_on_mean_and_forcing():
    torch.manual_seed(0)
    regression = RegressionTask(_model_cfg(), CHANNELS, GRID).build_model()
    task = ResidualDiffusionTask(_model_cfg(), CHANNELS, GRID, regression, OmegaConf.structured(SamplingConfig))
    model = task.build_model()
    assert model.net.net.config.cond_channels == 2 * CHANNELS.state + CHANNELS.forcing
    assert not any(p.requires_grad for p in task.regression.parameters())
    loss = task.loss(model, _batch(), seed=1, sample_ids=torch.arange(2))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is None for p in task.regression.parameters())
