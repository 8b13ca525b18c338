"""F.linear / matmul on token- and spatially-sharded inputs: local, exact, weight grads summed once."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

LAYOUTS = [(1,), (2,), (3,), (4,), (2, 2)]


class TokenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 6, bias=False)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))) + x


def _cases(mesh):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(3, 11, 6, generator=gen)  # (N, L, E), L sharded
    field = torch.randn(2, 7, 5, 6, generator=gen)  # channels-last (N, H, W, C)
    weight = torch.randn(4, 6, generator=gen)
    token_p = [Shard(1)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    field_p = [Shard(1)] if mesh.ndim == 1 else [Shard(1), Shard(2)]
    torch.manual_seed(1)
    return [
        ("mlp_tokens", TokenMLP(), [tokens], [token_p]),
        ("mlp_field", TokenMLP(), [field], [field_p]),
        ("matmul", lambda x, w: x @ w.t(), [field, weight], [field_p, None]),
        ("torch_matmul", lambda x, w: torch.matmul(x, w.t()).relu(), [tokens, weight], [token_p, None]),
    ]


def _run(mesh_shape, skewed):
    mesh = get_mesh(mesh_shape)
    for name, fn, inputs, placements in _cases(mesh):
        sizes = None
        if skewed and mesh.size(0) > 1:
            dim = placements[0][0].dim
            extent = inputs[0].shape[dim]
            sizes = [{0: [1] * (mesh.size(0) - 1) + [extent - mesh.size(0) + 1]}] + [None] * (len(inputs) - 1)
        try:
            assert_sharded_matches(fn, inputs, mesh, placements, sharding_sizes=sizes, atol=1e-5, rtol=1e-4)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error
    return True


@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_linear_family_matches_single_device(mesh_shape, skewed):
    run_on_ranks(math.prod(mesh_shape), _run, mesh_shape, skewed)


def _linear_sends_only_weight_grads(world):
    mesh = get_mesh((world,))
    layer = nn.Linear(6, 4)
    x = distribute_tensor(torch.randn(2, 9, 6), mesh, [Shard(1)])
    with count_communication() as log:
        y = layer(x)
    assert log.calls == 0
    loss = y.sum()
    with count_communication() as log:
        loss.backward()
    return [(record.kind, record.bytes_sent) for record in log.records]


@pytest.mark.parametrize("world", [2, 3])
def test_linear_forward_sends_nothing_and_backward_reduces_each_parameter_once(world):
    for records in run_on_ranks(world, _linear_sends_only_weight_grads, world):
        # weight (4x6) and bias (4) summed once, together in one bucket
        assert records == [("all_reduce", (4 * 6 + 4) * 4)], records
