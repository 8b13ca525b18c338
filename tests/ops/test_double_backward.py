"""Double backward (create_graph=True, then backward) on ShardTensors: equal to one device, or a
clear error where an op's explicit backward is not itself differentiable (never silently wrong)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from physics_dp.shard_tensor import Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

WEIGHT = torch.linspace(-1, 1, 4 * 3 * 9).reshape(4, 3, 3, 3)

# Paths made of pointwise ops, reductions, views and conversions: differentiable twice.
TWICE_DIFFERENTIABLE = {
    "pointwise": lambda x: torch.tanh(x) * x,
    "reductions": lambda x: torch.sin(x) * x.mean(dim=2, keepdim=True) + x.sum() * 0.01,
    "views": lambda x: torch.tanh(x.flatten(2)).reshape(2, 3, 7, 6) * x,
    "roll": lambda x: torch.roll(torch.tanh(x), 2, dims=2) * x,
    "conversions": lambda x: ShardTensor.from_local(torch.tanh(x.to_local()), x.device_mesh, x.placements)
    * x.redistribute(placements=[Replicate()]),
}
# Explicit backwards that communicate (halo exchanges, global statistics, index exchanges): refused.
ONCE_DIFFERENTIABLE = {
    "conv": lambda x: torch.tanh(F.conv2d(x, WEIGHT, padding=1)),
    "conv_circular": lambda x: torch.tanh(F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), WEIGHT)),
    "group_norm": lambda x: F.group_norm(torch.tanh(x), 3),
    "avg_pool": lambda x: F.avg_pool2d(torch.tanh(x), 2),
    "max_pool": lambda x: F.max_pool2d(x * x, 2),
    "interpolate": lambda x: F.interpolate(torch.tanh(x), scale_factor=2, mode="bilinear"),
    "index_select": lambda x: torch.tanh(x).index_select(2, torch.tensor([0, 5, 3])),
    "gather": lambda x: torch.tanh(x).gather(2, torch.zeros(2, 3, 7, 6, dtype=torch.long)),
}


def _gradient_penalty_grad(fn, x):
    """d/dx of |d(sum fn(x)^2)/dx|^2: a gradient penalty, as physics-informed losses build."""
    (gx,) = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    return x.grad


def _double_backward_cases(world):
    mesh = get_mesh((world,))
    g = torch.randn(2, 3, 7, 6, generator=torch.Generator().manual_seed(0))
    for name, fn in TWICE_DIFFERENTIABLE.items():
        sharded = _gradient_penalty_grad(fn, distribute_tensor(g.clone(), mesh, [Shard(2)]).requires_grad_(True))
        reference = _gradient_penalty_grad(
            lambda t: fn_plain(name, t), g.clone().requires_grad_(True)
        )
        torch.testing.assert_close(sharded.full_tensor(), reference, rtol=1e-4, atol=1e-4, msg=name)
    for name, fn in ONCE_DIFFERENTIABLE.items():
        x = distribute_tensor(g.clone(), mesh, [Shard(2)]).requires_grad_(True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            _gradient_penalty_grad(fn, x)
    return True


def fn_plain(name, t):
    if name == "conversions":  # the same function without the conversions
        return torch.tanh(t) * t
    return TWICE_DIFFERENTIABLE[name](t)


@pytest.mark.parametrize("world", [2, 3])
def test_double_backward_equals_one_device_or_raises(world):
    run_on_ranks(world, _double_backward_cases, world)
