"""SongUNet: unsharded shape and size checks, and sharded == single device on 1-D and 2-D meshes."""

from __future__ import annotations

import math

import pytest
import torch

from physics_dp.models.song_unet import SongUNet, SongUNetConfig
from physics_dp.shard_tensor import Shard
from physics_dp.testing import assert_sharded_matches, get_mesh, run_on_ranks

TINY = dict(
    img_resolution=16,
    in_channels=2,
    out_channels=2,
    cond_channels=1,
    model_channels=8,
    channel_mult=(1, 2),
    num_blocks=1,
    attn_resolutions=(8,),
    num_heads=2,
)
TINY_PARAMETERS = 45186


def _tiny(seed: int = 0, **overrides) -> SongUNet:
    torch.manual_seed(seed)
    return SongUNet(SongUNetConfig(**{**TINY, **overrides}))


def _inputs(height: int, width: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, height, width, generator=gen)
    noise_labels = torch.randn(2, generator=gen)
    condition = torch.randn(2, 1, height, width, generator=gen)
    return x, noise_labels, condition


def test_forward_shape_unsharded():
    model = _tiny()
    for height, width in [(16, 16), (16, 12)]:
        x, labels, condition = _inputs(height, width)
        assert model(x, labels, condition).shape == (2, 2, height, width)


def test_condition_is_checked():
    x, labels, condition = _inputs(16, 16)
    with pytest.raises(ValueError, match="condition"):
        _tiny()(x, labels)
    with pytest.raises(ValueError, match="cond_channels=0"):
        _tiny(cond_channels=0)(x, labels, condition)


def test_num_parameters():
    model = _tiny()
    assert model.num_parameters() == sum(p.numel() for p in model.parameters()) == TINY_PARAMETERS
    model.out_conv.weight.requires_grad_(False)
    assert model.num_parameters(trainable_only=True) == TINY_PARAMETERS - model.out_conv.weight.numel()
    # More channels, more parameters; attention adds parameters too.
    assert _tiny(model_channels=16).num_parameters() > TINY_PARAMETERS
    assert _tiny(attn_resolutions=()).num_parameters() < TINY_PARAMETERS


def _placements(mesh):
    return [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]


def _sharded_matches(mesh_shape, height, width, downsample):
    mesh = get_mesh(mesh_shape)
    model = _tiny(downsample=downsample)
    x, labels, condition = _inputs(height, width)
    p = _placements(mesh)
    report = assert_sharded_matches(model, [x, labels, condition], mesh, [p, None, p], atol=1e-4, rtol=1e-4)
    # The output stays domain-sharded like the input (no silent gather to a replicated result).
    assert report.output_placements == [tuple(p)], report.output_placements
    return max(report.max_abs_diff.values())


LAYOUTS = [(1,), (2,), (3,), (4,), (2, 2)]


@pytest.mark.parametrize("downsample", ["conv", "pool"])
@pytest.mark.parametrize("size", [(16, 16), (16, 12)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_sharded_matches_single_device(mesh_shape, size, downsample):
    worst = run_on_ranks(math.prod(mesh_shape), _sharded_matches, mesh_shape, *size, downsample, timeout=120.0)
    assert all(w <= 1e-4 for w in worst)
