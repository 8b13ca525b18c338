"""``torch.unique`` of a sharded tensor equals one device's, on every rank; only unique values travel.

Before ``unique.py`` it raised (DTensor has no rule for ``_unique2``).
"""

from __future__ import annotations

import math

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops._local import ShardedOpError
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

LAYOUTS = {
    "1 rank": ((1,), [Shard(1)], None),
    "2 ranks, uneven": ((2,), [Shard(1)], {0: [2, 5]}),
    "3 ranks, an empty shard": ((3,), [Shard(1)], {0: [3, 0, 4]}),
    "2 x 2, H and W": ((2, 2), [Shard(1), Shard(2)], {0: [7, 0], 1: [1, 4]}),
    "2 x 2, batch replicated": ((2, 2), [Replicate(), Shard(1)], None),
}
OPTIONS = ({}, {"return_inverse": True}, {"return_counts": True}, {"return_inverse": True, "return_counts": True}, {"sorted": False})


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 6, (2, 7, 5), generator=gen),
        torch.randint(0, 3, (2, 7, 5), generator=gen).float() * 0.5,
        torch.rand(2, 7, 5, generator=gen) > 0.5,
    ]


def _matches(layout: str) -> int:
    mesh_shape, placements, sizes = LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    checked = 0
    for x in _inputs():
        sharded = distribute_tensor(x, mesh, placements, sizes)
        for options in OPTIONS:
            got, want = torch.unique(sharded, **options), torch.unique(x, **options)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g.full_tensor(), w), f"{x.dtype} {options}: {g.full_tensor()} != {w}"
            checked += 1
        assert torch.equal(sharded.unique().full_tensor(), x.unique())
    return checked


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unique_matches_single_device(layout: str) -> None:
    world = math.prod(LAYOUTS[layout][0])
    assert run_on_ranks(world, _matches, layout) == [3 * len(OPTIONS)] * world


def _traffic_and_refusals() -> int:
    mesh = get_mesh((2,))
    x = distribute_tensor(torch.arange(2 * 64 * 64).remainder(3).view(2, 64, 64), mesh, [Shard(1)])
    with count_communication() as log:
        torch.unique(x, return_counts=True)
    with pytest.raises(ShardedOpError, match="NaN"):
        torch.unique(distribute_tensor(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), mesh, [Shard(0)]))
    with pytest.raises(ShardedOpError, match="dim=None"):
        torch.unique(x, dim=1)
    return log.bytes_sent


def test_only_unique_values_travel_and_nan_or_dim_raise() -> None:
    """Three values in a 64 KiB slab: a few bytes of sizes, values and counts, never the slab."""
    sent = run_on_ranks(2, _traffic_and_refusals)
    assert all(0 < nbytes < 200 for nbytes in sent), sent
