"""Every known unsupported combination, in one list: each raises naming the op, the placements
and the reason, on every rank, instead of returning a wrong answer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from physics_dp.shard_tensor import Partial, Shard, ShardingRuleError, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks


@torch.library.custom_op("physics_dp_tests::no_rule", mutates_args=())
def no_rule(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@no_rule.register_fake
def _(x):
    return torch.empty_like(x)


def _field(mesh, placements, shape=(2, 4, 9, 6)):
    return distribute_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(0)), mesh, placements)


def _tokens(mesh, dim=2):
    return distribute_tensor(torch.randn(2, 2, 9, 8, generator=torch.Generator().manual_seed(1)), mesh, [Shard(dim)])


# name -> (call(mesh), op name in the message, reason fragment)
UNSUPPORTED = {
    "conv2d, channels sharded": (lambda m: F.conv2d(_field(m, [Shard(1)]), torch.randn(3, 4, 3, 3)), "conv2d", "channel"),
    "conv2d, pending reduction": (
        lambda m: F.conv2d(ShardTensor.from_local(torch.randn(2, 4, 9, 6), m, [Partial("sum")]), torch.randn(3, 4, 3, 3)),
        "conv2d",
        "Partial",
    ),
    "group_norm, channels sharded": (lambda m: F.group_norm(_field(m, [Shard(1)]), 2), "group_norm", "channel"),
    "attention with dropout": (
        lambda m: F.scaled_dot_product_attention(_tokens(m), _tokens(m), _tokens(m), dropout_p=0.1),
        "scaled_dot_product_attention",
        "dropout_p",
    ),
    "attention, embedding dim sharded": (
        lambda m: F.scaled_dot_product_attention(_tokens(m), _tokens(m), _tokens(m, dim=3)),
        "scaled_dot_product_attention",
        "embedding dim",
    ),
    "antialiased interpolation keeping a dim its factor would change, differentiated": (
        lambda m: F.interpolate(_field(m, [Shard(2)]).requires_grad_(), scale_factor=(0.5, 1.05), mode="bilinear", antialias=True),
        "interpolate",
        "antialias",
    ),
    "unique slices over a sharded tensor": (lambda m: torch.unique(_field(m, [Shard(2)]), dim=1), "unique", "dim=None"),
    "in-place squeeze of a size-1 dim split over ranks": (
        lambda m: distribute_tensor(torch.zeros(2, 1, 4), m, [Shard(1)]).squeeze_(1),
        "squeeze_",
        "out-of-place",
    ),
    "roll without dims": (lambda m: torch.roll(_field(m, [Shard(2)]), 2), "roll", ""),
    "cross_entropy, classes sharded": (
        lambda m: F.cross_entropy(_field(m, [Shard(1)]), torch.zeros(2, 9, 6, dtype=torch.long)),
        "cross_entropy",
        "class dim",
    ),
    "a loss kernel averaging over slabs": (
        lambda m: torch._C._nn.mse_loss(_field(m, [Shard(2)]), _field(m, [Shard(2)]), 1),
        "mse_loss",
        "reduction='none'",
    ),
    "op without a sharding rule": (lambda m: no_rule(_field(m, [Shard(2)])), "physics_dp_tests.no_rule", "no sharding rule"),
}


def _raises(name):
    mesh = get_mesh((2,))
    call, op, reason = UNSUPPORTED[name]
    with pytest.raises((NotImplementedError, ShardingRuleError)) as info:
        call(mesh)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_combination_raises_a_clear_error(name):
    _, op, reason = UNSUPPORTED[name]
    for message in run_on_ranks(2, _raises, name):
        assert op in message, message
        assert "Shard(dim=" in message or "Partial" in message, message
        assert reason in message, message
