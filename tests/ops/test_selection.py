"""topk over sharded dims equals one device, forward and backward, and sends about k rows per rank
(DTensor's rule gathers every slab on every rank).

Inputs of the family are random normals (tie-free), so values, indices and gradients equal one device
exactly.  Where values tie, torch's CPU topk orders the equal elements as its selection algorithm
leaves them (not stable, not documented): there values equal one device's and every index names an
element of its value, and the gradient goes where the indices say.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Partial, Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_shape_ops import LAYOUTS, check_family, randn, world_of

nan = math.nan

FAMILY: dict[str, Callable] = {
    "topk(3, 2)": lambda x: x.topk(3, 2),
    "topk(2, 2, largest=False)": lambda x: torch.topk(x, 2, 2, largest=False),
    "topk(5, 2): more than some slabs hold": lambda x: x.topk(5, 2),
    "topk(H, 2): the whole dim": lambda x: x.topk(x.shape[2], 2, largest=False),
    "topk(1, 2)": lambda x: x.topk(1, dim=2),
    "topk(0, 2)": lambda x: x.topk(0, 2),
    "topk(3, -1)": lambda x: x.topk(3, -1),
    "topk(2), the last dim by default": lambda x: torch.topk(x, 2),
    "topk(2, 1), an unsharded dim": lambda x: x.topk(2, 1),
    "topk(2, 0)": lambda x: x.topk(2, 0, largest=False),
    "topk(4, 2, sorted=False), sorted after": lambda x: x.topk(4, 2, sorted=False).values.sort(2).values,
    "topk(3, 2) of x * x": lambda x: (x * x).topk(3, 2).values,
    "topk(2, 2) with x, broadcast": lambda x: x.topk(2, 2).values.mean(2, keepdim=True) * x,
}


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_topk_matches_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)


def _nan_rows() -> bool:
    """One NaN per row along H (no tie among NaNs): it is the largest, as in torch, for either flag."""
    mesh = get_mesh((3,))
    t = randn((2, 3, 9, 4))
    t[:, :, 4] = nan
    t[1, 2, 5, 1] = math.inf
    for fn in (lambda x: x.topk(3, 2), lambda x: x.topk(9, 2, largest=False), lambda x: x.topk(2, 2, largest=False)):
        for sizes in ([3, 3, 3], [2, 0, 7], [0, 8, 1]):
            assert_sharded_matches(fn, [t], mesh, [[Shard(2)]], sharding_sizes=[{0: sizes}])
    return True


def test_nan_is_largest_as_in_torch() -> None:
    assert all(run_on_ranks(3, _nan_rows))


# ----- ties: values exact, indices consistent, gradient where the indices say ---------------------------------
def _consistent(x: torch.Tensor, got, want, dim: int, in_order: bool) -> None:
    """Values equal one device's (as sets where unsorted); each row's indices are distinct and name its values."""
    values, indices = got.values.full_tensor(), got.indices.full_tensor()
    arranged = (lambda v: v) if in_order else (lambda v: v.sort(dim).values)
    assert torch.allclose(arranged(values), arranged(want.values), equal_nan=True)
    assert torch.allclose(x.gather(dim, indices), values, equal_nan=True)
    assert (indices.sort(dim).values.diff(dim=dim) > 0).all(), "an index twice in one row"


def _ties(world: int) -> bool:
    """Small integers (many ties, across rank boundaries too) and NaNs, in several dtypes and splits."""
    mesh = get_mesh((world,))
    base = torch.randint(0, 3, (2, 11, 5), generator=torch.Generator().manual_seed(1))
    floats = base.float().masked_fill(base == 2, 1.0)
    floats[0, 4, 1] = floats[1, 0, 2] = floats[1, 7, 2] = floats[1, 9, 2] = nan
    splits = {2: ([5, 6], [0, 11]), 3: ([3, 0, 8], [4, 4, 3]), 4: ([1, 0, 2, 8], [3, 3, 3, 2])}[world]
    for tensor in (floats, floats.half(), base, base.int()):
        for sizes in splits:
            x = distribute_tensor(tensor, mesh, [Shard(1)], {0: sizes})
            for k in (1, 3, 6, 11):
                for largest in (True, False):
                    for in_order in (True, False):
                        got = x.topk(k, 1, largest=largest, sorted=in_order)
                        want = tensor.topk(k, 1, largest=largest, sorted=in_order)
                        _consistent(tensor, got, want, 1, in_order)
    x = distribute_tensor(floats, mesh, [Shard(1)], {0: splits[0]}).requires_grad_(True)
    got = x.topk(4, 1, largest=False)
    cotangent = randn(tuple(got.values.shape), seed=2)
    got.values.backward(distribute_tensor(cotangent, mesh, got.values.placements))
    expected = torch.zeros_like(floats).scatter(1, got.indices.full_tensor(), cotangent)
    assert torch.equal(x.grad.full_tensor(), expected) and x.grad._spec == x._spec
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ties_give_one_devices_values_and_consistent_indices(world: int) -> None:
    assert all(run_on_ranks(world, _ties, world))


# ----- layout and traffic -------------------------------------------------------------------------------------
def _records(log) -> list[tuple[str, int]]:
    return [(r.kind, r.bytes_sent) for r in log.records]


def _one_axis_traffic() -> dict:
    """(1, C, 64, 8) float32 split [24, 40] on H over 2 ranks: a row is (1, C, 1, 8).  Each k has its own
    C: DTensor's rule, whose cache in torch 2.13 ignores k, would otherwise mistake the second call."""
    mesh = get_mesh((2,))
    found = {}
    for k, channels in ((2, 4), (40, 2)):
        x = distribute_tensor(randn((1, channels, 64, 8)), mesh, [Shard(2)], {0: [24, 40]}).requires_grad_(True)
        with count_communication() as forward:
            values, indices = x.topk(k, 2)
        with count_communication() as backward:
            values.backward(torch.ones_like(values))
        in_place = x.grad._spec == x._spec
        found[k] = (values.placements, indices.placements, _records(forward), _records(backward), in_place)
    return found


def test_on_two_ranks_topk_sends_k_candidate_rows_not_a_slab() -> None:
    """k = 2 (C = 4): each rank all-gathers 2 candidate rows of float32 values and int16 global indices
    (2 * 32 * 6 = 384 bytes; DTensor's rule sends the slab, 24 or 40 rows of 128 bytes).  k = 40 (C = 2)
    covers every slab: the slabs (rows of 64 bytes) travel without indices.  Backward sends nothing and
    keeps x's split."""
    slab = {0: 24 * 64, 1: 40 * 64}
    for rank, found in enumerate(run_on_ranks(2, _one_axis_traffic)):
        assert found[2] == ((Replicate(),), (Replicate(),), [("all_gather", 384)], [], True), (rank, found[2])
        assert found[40] == ((Replicate(),), (Replicate(),), [("all_to_all", slab[rank])], [], True), (rank, found[40])


def _two_axis_traffic() -> dict:
    """(1, 4, 16, 8) float32, H split [5, 11] on mesh axis 0 and W split [3, 5] on mesh axis 1."""
    mesh = get_mesh((2, 2))
    x = distribute_tensor(randn((1, 4, 16, 8)), mesh, [Shard(2), Shard(3)], {0: [5, 11], 1: [3, 5]})
    found = {}
    for dim in (2, 3):
        with count_communication() as forward:
            values = x.topk(2, dim).values
        found[dim] = (values.placements, values._spec.axis_sizes, _records(forward))
    return found, tuple(x._local_tensor.shape)


def test_on_a_two_by_two_mesh_the_other_axis_stays_sharded() -> None:
    """topk(2, 2) gathers 2 rows of (1, 4, 1, W-slab) over axis 0 and keeps W's split on axis 1; topk(2, 3)
    gathers 2 columns of (1, 4, H-slab, 1) over axis 1 and keeps H's split (6 bytes per candidate)."""
    for found, (_, _, rows, columns) in run_on_ranks(4, _two_axis_traffic):
        assert found[2] == ((Replicate(), Shard(3)), (None, (3, 5)), [("all_gather", 2 * 4 * columns * 6)])
        assert found[3] == ((Shard(2), Replicate()), ((5, 11), None), [("all_gather", 2 * 4 * rows * 6)])


# ----- refusals and pending reductions --------------------------------------------------------------------------
def _raises_on_every_rank() -> bool:
    """k beyond the dim and a dtype torch's topk refuses raise on every rank, an empty one too (no hang)."""
    mesh = get_mesh((3,))
    x = distribute_tensor(randn((2, 9, 4)), mesh, [Shard(1)], {0: [3, 0, 6]})
    with pytest.raises(RuntimeError, match="selected index k out of range"):
        x.topk(10, 1)
    with pytest.raises(RuntimeError, match="bool"):
        (x > 0).topk(2, 1)
    return True


def test_bad_calls_raise_on_every_rank() -> None:
    assert all(run_on_ranks(3, _raises_on_every_rank))


def _partial_input() -> bool:
    """A pending sum (Partial) is reduced first; the result and gradient come back without it."""
    mesh = get_mesh((2, 2))
    t = randn((2, 3, 7, 5))
    x = distribute_tensor(t, mesh, [Replicate(), Shard(2)], {1: [2, 5]})
    x = x.redistribute(mesh, [Partial(), Shard(2)]).detach().requires_grad_(True)
    leaf = t.clone().requires_grad_(True)
    got, want = x.topk(3, 2).values, leaf.topk(3, 2).values
    assert got.placements == (Replicate(), Replicate())
    assert torch.equal(got.full_tensor(), want)
    cotangent = randn(tuple(want.shape), seed=3)
    got.backward(distribute_tensor(cotangent, mesh, got.placements))
    want.backward(cotangent)
    assert torch.equal(x.grad.full_tensor(), leaf.grad)
    return True


def test_partial_inputs_are_reduced_first() -> None:
    assert all(run_on_ranks(4, _partial_input))
