"""Modules whose parameters are Replicate DTensors (torch's distribute_module) run on ShardTensors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor as dt_distribute

from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks


class ConvNormLinear(nn.Module):
    """Conv, transposed conv, GroupNorm, LayerNorm, Linear, and a user-level parameter product."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.layer_norm = nn.LayerNorm(4)
        self.linear = nn.Linear(4, 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(F.silu(self.norm(self.conv(x))))
        h = self.linear(self.layer_norm(h.permute(0, 2, 3, 1)))
        return h * self.gain


def _replicated_module_matches_one_device(world):
    mesh = get_mesh((world,))
    torch.manual_seed(0)
    reference = ConvNormLinear()
    model = distribute_module(copy.deepcopy(reference), mesh)  # Replicate DTensor parameters
    field = torch.randn(2, 3, 7, 5)
    cotangent = torch.randn(2, 14, 10, 3)

    x = distribute_tensor(field, mesh, [Shard(2)]).requires_grad_(True)
    y = model(x)
    (y * distribute_tensor(cotangent, mesh, [Shard(1)])).sum().backward()
    ref_x = field.clone().requires_grad_(True)
    ref_y = reference(ref_x)
    (ref_y * cotangent).sum().backward()

    torch.testing.assert_close(y.full_tensor(), ref_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad, rtol=1e-4, atol=1e-5)
    for (name, param), (_, ref_param) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(param.grad, DTensor) and param.grad.placements == (Replicate(),), name
        torch.testing.assert_close(param.grad.to_local(), ref_param.grad, rtol=1e-4, atol=1e-4, msg=name)
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_distribute_module_parameters_work_with_gradients_in_their_own_type(world):
    run_on_ranks(world, _replicated_module_matches_one_device, world)


def _sharded_dtensor_parameter_is_refused():
    mesh = get_mesh((2,))
    weight = dt_distribute(torch.randn(4, 3, 3, 3), mesh, [Shard(0)]).requires_grad_(True)
    x = distribute_tensor(torch.randn(1, 3, 6, 6), mesh, [Shard(2)])
    with pytest.raises(ValueError, match="only Replicate DTensor parameters"):
        F.conv2d(x, weight, padding=1)
    return True


def test_a_sharded_dtensor_parameter_raises_a_clear_error():
    run_on_ranks(2, _sharded_dtensor_parameter_is_refused)
