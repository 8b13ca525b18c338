"""EDM preconditioner: coefficients, shapes, and the preconditioned SongUNet sharded == single device."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from physics_dp.models.edm import EDMPrecond, edm_coefficients
from physics_dp.models.song_unet import SongUNet, SongUNetConfig
from physics_dp.shard_tensor import Shard
from physics_dp.testing import assert_sharded_matches, get_mesh, run_on_ranks

from .test_song_unet import TINY


def _precond(seed: int = 0, sigma_data: float = 0.5) -> EDMPrecond:
    torch.manual_seed(seed)
    return EDMPrecond(SongUNet(SongUNetConfig(**TINY)), sigma_data=sigma_data)


def _inputs(height: int, width: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, height, width, generator=gen)
    sigma = torch.exp(torch.randn(2, generator=gen) * 1.2 - 1.2)  # log-normal, as in EDM training
    condition = torch.randn(2, 1, height, width, generator=gen)
    return x, sigma, condition


class _Recorder(nn.Module):
    """Backbone returning a fixed field and remembering what it was called with."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value
        self.calls = []

    def forward(self, x, noise_labels, condition=None):
        self.calls.append((x, noise_labels, condition))
        return self.value


def test_coefficients_match_formulas():
    sigma = torch.tensor([0.002, 0.5, 1.0, 80.0], dtype=torch.float64)
    sd = 0.5
    c_skip, c_out, c_in, c_noise = edm_coefficients(sigma, sd)
    for i, s in enumerate(sigma.tolist()):
        assert c_skip[i].item() == pytest.approx(sd**2 / (s**2 + sd**2))
        assert c_out[i].item() == pytest.approx(s * sd / math.sqrt(s**2 + sd**2))
        assert c_in[i].item() == pytest.approx(1 / math.sqrt(sd**2 + s**2))
        assert c_noise[i].item() == pytest.approx(math.log(s) / 4)
    # Consequences used by EDM: the network input has unit variance, and c_out^2 = sd^2 (1 - c_skip).
    torch.testing.assert_close(c_in**2 * (sigma**2 + sd**2), torch.ones_like(sigma))
    torch.testing.assert_close(c_out**2, sd**2 * (1 - c_skip))


def test_wrapper_applies_preconditioning():
    x, sigma, condition = _inputs(8, 6)
    f = torch.randn_like(x)
    net = _Recorder(f)
    out = EDMPrecond(net, sigma_data=0.7)(x, sigma, condition)
    c_skip, c_out, c_in, c_noise = edm_coefficients(sigma, 0.7)
    b = (slice(None), None, None, None)
    torch.testing.assert_close(out, c_skip[b] * x + c_out[b] * f)
    seen_x, seen_labels, seen_condition = net.calls[0]
    torch.testing.assert_close(seen_x, c_in[b] * x)
    torch.testing.assert_close(seen_labels, sigma.log() / 4)
    assert seen_condition is condition


def test_sigma_forms():
    x, sigma, condition = _inputs(8, 6)
    net = _Recorder(torch.zeros_like(x))
    precond = EDMPrecond(net)
    torch.testing.assert_close(precond(x, 2.0), precond(x, torch.full((2,), 2.0)))
    with pytest.raises(ValueError, match="sigma must have shape"):
        precond(x, torch.ones(3))
    with pytest.raises(ValueError, match="sigma_data"):
        EDMPrecond(net, sigma_data=0.0)


def test_precond_song_unet_shape_and_parameters():
    precond = _precond()
    for height, width in [(16, 16), (16, 12)]:
        x, sigma, condition = _inputs(height, width)
        assert precond(x, sigma, condition).shape == (2, 2, height, width)
    assert precond.num_parameters() == precond.net.num_parameters()


def _placements(mesh):
    return [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]


def _sharded_matches(mesh_shape, height, width):
    mesh = get_mesh(mesh_shape)
    model = _precond()
    x, sigma, condition = _inputs(height, width)
    p = _placements(mesh)
    report = assert_sharded_matches(model, [x, sigma, condition], mesh, [p, None, p], atol=1e-4, rtol=1e-4)
    assert report.output_placements == [tuple(p)], report.output_placements
    return max(report.max_abs_diff.values())


@pytest.mark.parametrize("size", [(16, 16), (16, 12)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (3,)], ids=str)
def test_sharded_matches_single_device(mesh_shape, size):
    worst = run_on_ranks(math.prod(mesh_shape), _sharded_matches, mesh_shape, *size, timeout=120.0)
    assert all(w <= 1e-4 for w in worst)
