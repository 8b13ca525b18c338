"""EDM Heun sampler: the noise schedule, the exact answer for Gaussian data, and sharded == single device."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from physics_dp.diffusion import derive_seed, edm_sampler, edm_sigma_steps, randn_like_global
from physics_dp.models import EDMPrecond, SongUNet, SongUNetConfig
from physics_dp.shard_tensor import Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

from .test_loss import TINY

MU = torch.tensor([0.3, -1.0], dtype=torch.float64).view(1, 2, 1, 1)
STD = torch.tensor([0.5, 1.5], dtype=torch.float64).view(1, 2, 1, 1)


def gaussian_denoiser(x: torch.Tensor, sigma: torch.Tensor, condition=None) -> torch.Tensor:
    """The exact denoiser E[y | y + sigma n = x] for data y ~ N(MU, STD^2) per channel."""
    sigma = sigma.view(-1, 1, 1, 1)
    return MU + STD**2 / (STD**2 + sigma**2) * (x - MU)


def test_sigma_steps():
    steps = edm_sigma_steps(18, 0.002, 80.0, 7.0)
    assert len(steps) == 19 and steps[-1] == 0.0
    assert steps[0] == pytest.approx(80.0) and steps[-2] == pytest.approx(0.002)
    assert all(a > b for a, b in zip(steps, steps[1:]))
    # rho = 1 spaces the levels evenly.
    assert edm_sigma_steps(3, 1.0, 3.0, 1.0) == pytest.approx([3.0, 2.0, 1.0, 0.0])
    assert edm_sigma_steps(1, 0.002, 80.0, 7.0) == [80.0, 0.0]
    with pytest.raises(ValueError, match="sigma_min < sigma_max"):
        edm_sigma_steps(4, 1.0, 0.5, 7.0)
    with pytest.raises(ValueError, match="num_steps"):
        edm_sigma_steps(0, 0.002, 80.0, 7.0)


def _ode_error(num_steps: int) -> float:
    """Largest relative error of the Heun ODE solve against the exact probability-flow solution.

    For Gaussian data the ODE dx/dt = (x - D(x; t)) / t has x(t) - MU proportional to
    sqrt(STD^2 + t^2), so x(0) = MU + (x(T) - MU) * STD / sqrt(STD^2 + T^2).
    """
    like = torch.empty(2, 2, 8, 6, dtype=torch.float64)
    x = edm_sampler(gaussian_denoiser, like, seed=1, sample_ids=[0, 1], num_steps=num_steps)
    start = 80.0 * randn_like_global(like, derive_seed(1, 0), [0, 1])
    exact = MU + (start - MU) * STD / torch.sqrt(STD**2 + 80.0**2)
    return ((x - exact) / (exact - MU)).abs().max().item()


def test_deterministic_sampler_solves_the_gaussian_ode_to_second_order():
    coarse, fine = _ode_error(18), _ode_error(40)
    assert coarse < 0.08
    order = math.log(coarse / fine) / math.log(40 / 18)
    assert order > 1.7, order  # Heun; an Euler step would give about 1


def test_stochastic_sampler_keeps_the_data_distribution():
    like = torch.empty(8, 2, 32, 32, dtype=torch.float64)
    deterministic = edm_sampler(gaussian_denoiser, like, seed=2, sample_ids=range(8))
    churned = edm_sampler(gaussian_denoiser, like, seed=2, sample_ids=range(8), s_churn=40.0)
    assert not torch.allclose(churned, deterministic)
    torch.testing.assert_close(edm_sampler(gaussian_denoiser, like, seed=2, sample_ids=range(8), s_churn=40.0), churned)
    for x in (deterministic, churned):
        std = (x - MU).std(dim=(0, 2, 3))
        mean = (x - MU).mean(dim=(0, 2, 3))
        assert torch.allclose(std, STD.flatten(), rtol=0.15), std
        assert mean.abs().max() < 0.05
    # Half the churn noise leaves too little variance: the churn really adds noise.
    quiet = edm_sampler(gaussian_denoiser, like, seed=2, sample_ids=range(8), s_churn=40.0, s_noise=0.5)
    assert ((quiet - MU).std(dim=(0, 2, 3)) < 0.7 * STD.flatten()).all()


def test_runs_without_autograd():
    torch.manual_seed(0)
    model = EDMPrecond(SongUNet(SongUNetConfig(**TINY)))
    condition = torch.randn(1, 1, 16, 12)
    x = edm_sampler(model, torch.empty(1, 2, 16, 12), condition=condition, seed=0, sample_ids=[0], num_steps=2)
    assert x.shape == (1, 2, 16, 12) and not x.requires_grad and torch.isfinite(x).all()


def _sharded_sampler(mesh_shape, sizes):
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    model = EDMPrecond(SongUNet(SongUNetConfig(**TINY))).double()  # float64: a tight tolerance after 5 calls
    reference = copy.deepcopy(model)
    condition = torch.randn(2, 1, 16, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    latents = torch.empty(2, 2, 16, 12, dtype=torch.float64)
    p = [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]
    shard = lambda t: distribute_tensor(t, mesh, p, sizes)  # noqa: E731
    worst = 0.0
    for churn in (0.0, 30.0):
        kwargs = dict(seed=5, sample_ids=[4, 1], num_steps=3, s_churn=churn, s_min=0.01, s_max=50.0)
        expected = edm_sampler(reference, latents, condition=condition, **kwargs)
        x = edm_sampler(model, shard(latents), condition=shard(condition), **kwargs)
        assert isinstance(x, ShardTensor) and x.placements == tuple(p)
        torch.testing.assert_close(x.full_tensor(), expected, atol=1e-9, rtol=1e-9)
        worst = max(worst, (x.full_tensor() - expected).abs().max().item())
    return worst


SAMPLER_CASES = {"2-uneven": ((2,), {0: [11, 5]}), "3": ((3,), None), "2x2-uneven": ((2, 2), {0: [9, 7], 1: [7, 5]})}


@pytest.mark.parametrize("case", list(SAMPLER_CASES), ids=list(SAMPLER_CASES))
def test_sharded_matches_single_device(case):
    mesh_shape, sizes = SAMPLER_CASES[case]
    worst = run_on_ranks(math.prod(mesh_shape), _sharded_sampler, mesh_shape, sizes, timeout=120.0)
    assert max(worst) <= 1e-9
