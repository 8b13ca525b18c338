"""searchsorted / bucketize of sharded values against replicated boundaries equal one device, send nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import run_on_ranks

from .test_shape_ops import LAYOUTS, check_family, randn, sharding, world_of

_BOUNDARIES = torch.tensor([-1.0, -0.25, 0.0, 0.5, 1.0])
_UNSORTED = torch.tensor([0.5, -1.0, 1.0, 0.0])

FAMILY: dict[str, Callable] = {
    "searchsorted(b, x)": lambda x: torch.searchsorted(_BOUNDARIES, x),
    "searchsorted(b, x, right, int32)": lambda x: torch.searchsorted(_BOUNDARIES, x, right=True, out_int32=True),
    "searchsorted(b, x, side=right)": lambda x: torch.searchsorted(_BOUNDARIES, x, side="right"),
    "searchsorted with sorter": lambda x: torch.searchsorted(_UNSORTED, x, sorter=_UNSORTED.argsort()),
    "bucketize(x, b)": lambda x: torch.bucketize(x, _BOUNDARIES),
    "x * (bucketize(x, b, right) + 1)": lambda x: x * (torch.bucketize(x, _BOUNDARIES, right=True) + 1),
}


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bucketing_matches_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)


def _replicated_boundaries_send_nothing() -> None:
    mesh, placements, sizes = sharding("3", "skewed", (2, 3, 7, 5))
    values = randn((2, 3, 7, 5))
    x = distribute_tensor(values, mesh, placements, sizes)
    boundaries = distribute_tensor(_BOUNDARIES, mesh, [Replicate()])
    with count_communication() as log:
        buckets = torch.bucketize(x, boundaries)
        found = torch.searchsorted(boundaries, x)
    assert log.calls == 0
    assert buckets.placements == (Shard(2),) and buckets._spec.axis_sizes == x._spec.axis_sizes
    assert torch.equal(buckets.full_tensor(), torch.bucketize(values, _BOUNDARIES))
    assert torch.equal(found.full_tensor(), torch.searchsorted(_BOUNDARIES, values))


def test_replicated_boundaries_send_nothing() -> None:
    run_on_ranks(3, _replicated_boundaries_send_nothing)
