"""PadToMultiple: grids a network cannot take as they are (73 rows into a 2-level U-Net) run
unchanged, sharded over uneven rows, equal to one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from physics_dp.models import PadToMultiple, build_regression_unet
from physics_dp.shard_tensor import Shard
from physics_dp.testing import assert_sharded_matches, get_mesh, run_on_ranks

OPTIONS = dict(model_channels=8, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[], num_heads=1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_regression_unet(grid_shape=(13, 10), in_channels=2, out_channels=2, cond_channels=1, options=OPTIONS)


def test_pads_and_crops():
    model = _model()
    assert model.padded_shape(13, 10) == (14, 10)
    x, condition = torch.randn(2, 2, 13, 10), torch.randn(2, 1, 13, 10)
    assert model(x, condition).shape == (2, 2, 13, 10)
    inner_seen = []
    model.net.register_forward_pre_hook(lambda _, args: inner_seen.append(tuple(args[0].shape)))
    model(x, condition)
    assert inner_seen == [(2, 2, 14, 10)]


def test_no_padding_is_a_pass_through():
    calls = []
    wrapper = PadToMultiple(nn.Identity(), 2)
    wrapper.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(1, 1, 4, 6)
    assert wrapper(x) is x and calls == [1]
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        PadToMultiple(nn.Identity(), 0)


def _sharded(world: int) -> float:
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(1)
    x, condition = torch.randn(2, 2, 13, 10, generator=gen), torch.randn(2, 1, 13, 10, generator=gen)
    report = assert_sharded_matches(_model(), [x, condition], mesh, [[Shard(2)], [Shard(2)]], atol=1e-4, rtol=1e-4)
    return report.worst if hasattr(report, "worst") else 0.0


@pytest.mark.parametrize("world", [2, 3])
def test_odd_grid_sharded_matches_single_device(world):
    run_on_ranks(world, _sharded, world, timeout=120.0)
