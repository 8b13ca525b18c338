"""EDMLoss: the formula on one device, and sharded == single device (value and every parameter gradient)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from physics_dp.diffusion import EDMLoss, randn_like_global, sample_sigma_lognormal
from physics_dp.models import EDMPrecond, SongUNet, SongUNetConfig
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

from ..models.test_song_unet import TINY



class _Affine(nn.Module):
    """A denoiser D(x; sigma) = a * x / (1 + sigma) + b with learnable scalars (gradients checkable by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor(-0.2, dtype=torch.float64))

    def forward(self, x, sigma, condition=None):
        return self.a * x / (1 + sigma[:, None, None, None]) + self.b


def _batch(height=16, width=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(2, 2, height, width, generator=gen)
    condition = torch.randn(2, 1, height, width, generator=gen)
    mask = torch.rand(2, 2, height, width, generator=gen) > 0.3
    return target, condition, mask


def test_formula_with_mask_and_channel_weights():
    target = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    mask = torch.rand(3, 2, 5, 4) > 0.4
    weights = torch.tensor([0.5, 2.0], dtype=torch.float64)
    loss_fn = EDMLoss(p_mean=-1.0, p_std=1.5, sigma_data=0.4)
    model = _Affine()
    loss = loss_fn(model, target, seed=3, sample_ids=[4, 5, 6], channel_weights=weights, mask=mask)

    sigma = sample_sigma_lognormal(3, [4, 5, 6], -1.0, 1.5, dtype=torch.float64)[:, None, None, None]
    noisy = target + sigma * randn_like_global(target, 3, [4, 5, 6])
    weight = (sigma**2 + 0.16) / (sigma * 0.4) ** 2
    error = weight * weights[None, :, None, None] * (model(noisy, sigma.flatten()) - target) ** 2
    torch.testing.assert_close(loss, error[mask].mean())
    unmasked = loss_fn(model, target, seed=3, sample_ids=[4, 5, 6])
    torch.testing.assert_close(unmasked, (weight * (model(noisy, sigma.flatten()) - target) ** 2).mean())
    assert loss.ndim == 0 and loss.requires_grad


def test_noise_and_sigma_follow_seed_and_sample_ids():
    target = torch.randn(2, 2, 6, 5, dtype=torch.float64)
    loss_fn, model = EDMLoss(), _Affine()
    base = loss_fn(model, target, seed=0, sample_ids=[0, 1])
    assert loss_fn(model, target, seed=0, sample_ids=[0, 1]).item() == base.item()
    assert loss_fn(model, target, seed=1, sample_ids=[0, 1]).item() != base.item()
    assert loss_fn(model, target, seed=0, sample_ids=[2, 3]).item() != base.item()
    # Each sample's term depends on its own id only: a batch is the mean of its one-sample losses.
    singles = [loss_fn(model, target[i : i + 1], seed=0, sample_ids=[i]) for i in range(2)]
    torch.testing.assert_close(base, (singles[0] + singles[1]) / 2)


def test_errors_and_empty_mask():
    target = torch.randn(2, 2, 6, 5)
    loss_fn, model = EDMLoss(), _Affine().float()
    with pytest.raises(ValueError, match="channel_weights must have shape"):
        loss_fn(model, target, seed=0, sample_ids=[0, 1], channel_weights=torch.ones(3))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        loss_fn(model, target, seed=0, sample_ids=[0, 1], mask=torch.ones_like(target))
    with pytest.raises(ValueError, match="sigma_data"):
        EDMLoss(sigma_data=0)
    empty = loss_fn(model, target, seed=0, sample_ids=[0, 1], mask=torch.zeros_like(target, dtype=torch.bool))
    assert empty.item() == 0.0


def _placements(mesh):
    return [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]


def _sharded_loss(mesh_shape, sizes, use_mask, use_weights):
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    model = EDMPrecond(SongUNet(SongUNetConfig(**TINY)), sigma_data=0.5)
    reference = copy.deepcopy(model)
    target, condition, mask = _batch()
    kwargs = dict(seed=7, sample_ids=[3, 8], channel_weights=torch.tensor([1.0, 0.25]) if use_weights else None)
    loss_fn = EDMLoss()

    expected = loss_fn(reference, target, condition=condition, mask=mask if use_mask else None, **kwargs)
    expected.backward()

    p = _placements(mesh)
    shard = lambda t: distribute_tensor(t, mesh, p, sizes)  # noqa: E731
    loss = loss_fn(model, shard(target), condition=shard(condition), mask=shard(mask) if use_mask else None, **kwargs)
    assert type(loss) is torch.Tensor and loss.ndim == 0
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    worst = 0.0
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        worst = max(worst, (param.grad - ref.grad).abs().max().item())
    return worst


LOSS_CASES = {
    "2-uneven-plain": ((2,), {0: [10, 6]}, False, False),
    "3-uneven-mask-weights": ((3,), {0: [7, 4, 5]}, True, True),
    "2x2-mask": ((2, 2), {0: [9, 7], 1: [5, 7]}, True, False),
}


@pytest.mark.parametrize("case", list(LOSS_CASES), ids=list(LOSS_CASES))
def test_sharded_matches_single_device(case):
    mesh_shape, sizes, use_mask, use_weights = LOSS_CASES[case]
    worst = run_on_ranks(math.prod(mesh_shape), _sharded_loss, mesh_shape, sizes, use_mask, use_weights, timeout=120.0)
    assert max(worst) <= 1e-4
