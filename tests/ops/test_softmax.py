"""Softmax and log-softmax over sharded dims equal one device, forward and backward, and keep the
output sharded like the input (DTensor's rule would replicate the whole tensor on every rank)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_shape_ops import LAYOUTS, check_family, randn, world_of

FAMILY: dict[str, Callable] = {
    "softmax(2)": lambda x: F.softmax(x, 2),
    "softmax(-1)": lambda x: torch.softmax(x, -1),
    "log_softmax(2)": lambda x: F.log_softmax(x, 2),
    "log_softmax(-1)": lambda x: x.log_softmax(-1),
    "softmax(1), an unsharded dim": lambda x: F.softmax(x, 1),
    "softmax(2) with -inf entries": lambda x: F.softmax(x.masked_fill(x > 1.5, float("-inf")), 2),
    "softmax(2, dtype=float64)": lambda x: F.softmax(x, 2, dtype=torch.float64),
    "log_softmax(2) of a transposed view": lambda x: F.log_softmax(x.transpose(2, 3), 3),
}


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_softmax_matches_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)


def _layout_and_traffic() -> dict:
    mesh = get_mesh((2,))
    x = distribute_tensor(randn((1, 4, 16, 8)), mesh, [Shard(2)], {0: [5, 11]}).requires_grad_(True)
    found = {}
    for name, fn in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
        with count_communication() as forward:
            y = fn(x, 2)
        with count_communication() as backward:
            y.backward(torch.ones_like(y))
        found[name] = (y._spec == x._spec, forward.records, backward.records)
    return found


def test_the_output_stays_sharded_and_only_row_totals_travel() -> None:
    """Forward: one all-reduce of the row maxima and one of the row sums; backward: one of the row sums;
    each (1, 4, 1, 8) float32 values (128 bytes), where DTensor's rule replicated the tensor."""
    for found in run_on_ranks(2, _layout_and_traffic):
        for name, (same_spec, forward, backward) in found.items():
            assert same_spec, name
            assert [(r.kind, r.bytes_sent) for r in forward] == [("all_reduce", 128)] * 2, (name, forward)
            assert [(r.kind, r.bytes_sent) for r in backward] == [("all_reduce", 128)], (name, backward)


def _bfloat16_like_torch() -> bool:
    mesh = get_mesh((3,))
    x = randn((2, 3, 7, 5)).bfloat16()
    for fn in (lambda t: F.softmax(t, 2), lambda t: F.log_softmax(t, 2)):
        assert_sharded_matches(fn, [x], mesh, [[Shard(2)]], sharding_sizes=[{0: [1, 2, 4]}], atol=2e-2, rtol=2e-2)
    return True


def test_bfloat16_is_computed_in_float32_as_torch_does() -> None:
    assert all(run_on_ranks(3, _bfloat16_like_torch))
