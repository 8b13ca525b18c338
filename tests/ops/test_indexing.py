"""Slicing, select, index_select, gather, masks and roll along sharded dims equal one device.

Every function runs forward and backward on 1-4 ranks sharding H and on a 2x2 mesh sharding H
and W, with even, uneven and skewed (empty shard) splits.  Traffic checks: slicing and split
pieces send nothing, roll sends exactly the rows that cross rank boundaries, select broadcasts
one row, index_select fetches only the distinct rows a rank needs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops._local import ShardedOpError
from physics_dp.ops.indexing import roll_pieces, slice_plan
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_shape_ops import LAYOUTS, SHAPES, check_family, randn, run_combos, sharding, world_of


def _index(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _gather_index(shape: tuple[int, ...], dim: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, shape[dim], shape, generator=torch.Generator().manual_seed(seed))


SLICE_FAMILY: dict[str, Callable] = {
    "x[:, :, 1:5]": lambda x: x[:, :, 1:5],
    "x[..., 1:-1, :]": lambda x: x[..., 1:-1, :] * 2,
    "x[:, :, ::2]": lambda x: x[:, :, ::2],
    "x[:, :, 1::3]": lambda x: x[:, :, 1::3],
    "x[:, :, 5:]": lambda x: x[:, :, 5:],
    "x[:, :, 3:3]": lambda x: x[:, :, 3:3],
    "x[:, :, -100:100:4]": lambda x: x[:, :, -100:100:4],
    "x[:, :, 1:6:2, 1:4]": lambda x: x[:, :, 1:6:2, 1:4],
    "x[..., ::3]": lambda x: x[..., ::3],
    "x[:, 1:]": lambda x: x[:, 1:],
    "narrow(2, 2, 3)": lambda x: x.narrow(2, 2, 3),
    "narrow(-1, 1, 3)": lambda x: torch.narrow(x, -1, 1, 3),
    "x[:, :, 1:5][:, :, 1:3]": lambda x: x[:, :, 1:5][:, :, 1:3].exp(),
    "x[:, :, 2:] + x[:, :, :-2]": lambda x: x[:, :, 2:] + x[:, :, :-2],
    "x[:, :, 1:5].reshape": lambda x: x[:, :, 1:5].reshape(2, 3, -1),
}
def _doubled_row_in_place(x: torch.Tensor) -> torch.Tensor:
    """An in-place update through a select view: it must reach the tensor, and autograd sees it."""
    y = x * 1
    y[:, :, 2] *= 2
    y.select(2, -1).mul_(3)
    return y


SELECT_FAMILY: dict[str, Callable] = {
    "x[:, :, 3]": lambda x: x[:, :, 3],
    "x[:, :, -1]": lambda x: x[:, :, -1] * 2,
    "x[..., 2]": lambda x: x[..., 2],
    "x.select(2, 0)": lambda x: x.select(2, 0),
    "x[:, 1]": lambda x: x[:, 1],
    "x[1, :, 4, 1]": lambda x: x[1, :, 4, 1],
    "y[:, :, 2] *= 2, y.select(2, -1).mul_(3)": _doubled_row_in_place,
    "index_select(2, [0, 5, 2, 2, 6])": lambda x: x.index_select(2, _index([0, 5, 2, 2, 6])),
    "x[:, :, [4, 0, 4]], a list index": lambda x: x[:, :, [4, 0, 4]] * 2,
    "index_select(2, [6])": lambda x: torch.index_select(x, 2, _index([6])),
    "index_select(3, [4, 0, 1])": lambda x: x.index_select(3, _index([4, 0, 1])),
    "index_select(1, [2, 0])": lambda x: x.index_select(1, _index([2, 0])),
    "index_select(2, [])": lambda x: x.index_select(2, _index([])),
    "x[:, :, [1, 1, 6, 0]]": lambda x: x[:, :, _index([1, 1, 6, 0])],
    "x[..., [3, 0]]": lambda x: x[..., _index([3, 0])],
    "gather(2, index)": lambda x: x.gather(2, _gather_index(tuple(x.shape), 2)),
    "gather(3, index)": lambda x: torch.gather(x, 3, _gather_index(tuple(x.shape), 3)),
    "gather(2, short index)": lambda x: x.gather(2, _gather_index((2, 2, 3, x.shape[3]), 2) % x.shape[2]),
    "gather(1, index)": lambda x: x.gather(1, _gather_index(tuple(x.shape), 1)),
    "take_along_dim(argsort, 2)": lambda x: torch.take_along_dim(x, x.detach().argsort(2), 2),
}
def _rows_set(x: torch.Tensor, key: tuple, value: float | torch.Tensor) -> torch.Tensor:
    y = x * 1
    y[key] = value
    return y


_ROW_VALUES = torch.tensor([1.5, -2.0]).view(1, 1, 2, 1)
PUT_FAMILY: dict[str, Callable] = {
    "y[:, :, [0, 6]] = 9": lambda x: _rows_set(x, (slice(None), slice(None), [0, 6]), 9.0),
    "y[:, :, [0, -1]] = 0 (boundary rows)": lambda x: _rows_set(x, (slice(None), slice(None), [0, -1]), 0.0),
    "y[..., [4, 2], :] = rows": lambda x: _rows_set(x, (Ellipsis, [4, 2], slice(None)), _ROW_VALUES),
    "y[:, :, [3]] += 1": lambda x: _rows_set(x, (slice(None), slice(None), [3]), x[:, :, [3]] * 0 + 1) * x,
    "y[:, [0, 2]] = 0 (a whole dim)": lambda x: _rows_set(x, (slice(None), [0, 2]), 0.0),
    "index_fill_(2, [0, 3, -1], 2)": lambda x: (x * 1).index_fill_(2, torch.tensor([0, 3, -1]), 2.0),
    "index_fill(2, [1, 1, 5], -1) * 2": lambda x: x.index_fill(2, torch.tensor([1, 1, 5]), -1.0) * 2,
    "index_fill(3, [0, 4], 0-d tensor)": lambda x: x.index_fill(3, torch.tensor([0, 4]), torch.tensor(0.5)),
}
MASK_FAMILY: dict[str, Callable] = {
    "x[x > 0]": lambda x: x[x > 0],
    "x[x > 0.5] * 2": lambda x: x[x > 0.5] * 2,
    "x[(x > 9,)] (empty)": lambda x: x[(x > 9,)],
    "masked_select(x, x < 0)": lambda x: torch.masked_select(x, x < 0),
    "where(x > 0, x, -2x)": lambda x: torch.where(x > 0, x, -2 * x),
    "x * (x > 0)": lambda x: x * (x > 0),
    "masked_fill(x > 0, 1.5)": lambda x: x.masked_fill(x > 0, 1.5),
    "x[x.abs() > 1].sum()": lambda x: x[x.abs() > 1].sum(),
}
ROLL_FAMILY: dict[str, Callable] = {
    "roll(2, 2)": lambda x: torch.roll(x, 2, 2),
    "roll(-3, 2)": lambda x: x.roll(-3, 2),
    "roll(H + 4, 2)": lambda x: x.roll(x.shape[2] + 4, 2),
    "roll(-2H - 1, 2)": lambda x: x.roll(-2 * x.shape[2] - 1, 2),
    "roll(5, 2)": lambda x: x.roll(5, 2),
    "roll(0, 2)": lambda x: x.roll(0, 2),
    "roll((1, -2), (2, 3))": lambda x: x.roll((1, -2), (2, 3)),
    "roll((3, 1), (3, 1))": lambda x: torch.roll(x, (3, 1), (3, 1)),
    "roll(1, 1)": lambda x: x.roll(1, 1),
    "roll(2, -2) twice": lambda x: x.roll(2, -2).roll(-1, 2) * 2,
}
FAMILIES = {"slice": SLICE_FAMILY, "select": SELECT_FAMILY, "put": PUT_FAMILY, "mask": MASK_FAMILY, "roll": ROLL_FAMILY}


def _check(layout: str, family: str) -> list[str]:
    return check_family(layout, FAMILIES[family])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_indexing_matches_single_device(layout: str, family: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout, family)[0]
    assert len(checked) == len(SHAPES) * len(FAMILIES[family])


# Sharded second inputs: a mask, a gather index, or a value tensor, split like x.
def _check_sharded_operands(layout: str) -> list[str]:
    combos = {}
    for split, shape in SHAPES.items():
        mesh, placements, sizes = sharding(layout, split, shape)
        x = randn(shape)
        mask = randn(shape, 1) > 0
        index = _gather_index(shape, 2, 3)
        cases = {
            "x[mask]": (lambda x, m: x[m], mask),
            "masked_fill(mask, 0)": (lambda x, m: x.masked_fill(m, 0.0), mask),
            "where(mask, x, 1)": (lambda x, m: torch.where(m, x, torch.ones(())), mask),
            "gather(2, sharded index)": (lambda x, i: x.gather(2, i), index),
            "gather(2, index[:, :, :4])": (lambda x, i: x.gather(2, i[:, :, :4]), index),
        }
        for name, (fn, operand) in cases.items():
            combos[f"{name} on {layout} ({split})"] = _operand_check(fn, x, operand, mesh, placements, sizes)
    return run_combos(combos)


def _operand_check(fn: Callable, x: torch.Tensor, operand: torch.Tensor, mesh, placements, sizes) -> Callable[[], None]:
    return lambda: assert_sharded_matches(
        fn, [x, operand], mesh, [placements, placements], sharding_sizes=[sizes, sizes]
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_masks_and_indices(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check_sharded_operands, layout)[0]
    assert len(checked) == len(SHAPES) * 5


# ----- placements and communication -----------------------------------------------------------------------------
def _row_bytes(x) -> int:
    return x.shape[0] * x.shape[1] * x.shape[3] * x.element_size()


def _slicing_sends_nothing() -> None:
    mesh, placements, sizes = sharding("4", "skewed", (2, 3, 11, 5))
    x = distribute_tensor(randn((2, 3, 11, 5)), mesh, placements, sizes).requires_grad_(True)  # split 1, 0, 1, 9
    with count_communication() as log:
        y = x[:, :, 1:10:2]
        z = x.narrow(2, 0, 2)
    assert log.calls == 0, log.kinds()
    assert y.placements == (Shard(2),) and y._spec.axis_sizes[0] == (0, 0, 1, 4)
    assert z._spec.axis_sizes[0] == (1, 0, 1, 0)
    cotangent = distribute_tensor(randn(tuple(y.shape), 1), mesh, placements, {0: y._spec.axis_sizes[0]})
    with count_communication() as log:
        y.backward(cotangent)
    assert log.calls == 0, log.kinds()
    assert x.grad.shape == x.shape


def _rows_leaving(sizes: tuple[int, ...], shift: int, me: int) -> int:
    """Rows of rank ``me`` whose rolled position lies on another rank."""
    owner = [r for r, n in enumerate(sizes) for _ in range(n)]
    start = sum(sizes[:me])
    return sum(owner[(i + shift) % len(owner)] != me for i in range(start, start + sizes[me]))


def _roll_sends_only_crossing_rows() -> None:
    mesh, placements, _ = sharding("4", "even", (2, 3, 8, 8))
    me = mesh.get_coordinate()[0]
    even = (3, 3, 3, 3)
    for extent, sizes, shift in ((12, even, 1), (12, even, -2), (12, even, 17), (9, (0, 2, 1, 6), 4)):
        x = distribute_tensor(randn((2, 3, extent, 4)), mesh, placements, {0: sizes}).requires_grad_(True)
        with count_communication() as log:
            y = x.roll(shift, 2)
        assert set(log.kinds()) <= {"p2p"}, log.kinds()
        assert log.bytes_sent == _rows_leaving(sizes, shift, me) * _row_bytes(x), (shift, sizes, log.bytes_sent)
        assert y._spec == x._spec
        with count_communication() as back:
            y.backward(distribute_tensor(randn(tuple(y.shape), 1), mesh, placements, {0: sizes}))
        assert back.bytes_sent == _rows_leaving(sizes, -shift, me) * _row_bytes(x)


def _select_broadcasts_one_row() -> None:
    mesh, placements, _ = sharding("4", "even", (2, 3, 8, 8))
    x = distribute_tensor(randn((2, 3, 8, 5)), mesh, placements)
    with count_communication() as log:
        y = x[:, :, 5]
    owner = 2
    expected = 2 * 3 * 5 * 4 * 3 if mesh.get_coordinate()[0] == owner else 0
    assert log.kinds() == ["broadcast"] * (mesh.get_coordinate()[0] == owner) and log.bytes_sent == expected
    assert y.placements == (Replicate(),)
    x[:, :, 5].mul_(0)  # the owner's result is a view of its slab: in-place ops write through
    assert bool((x.full_tensor()[:, :, 5] == 0).all()) and bool((x.full_tensor()[:, :, 4] != 0).all())


def _index_select_fetches_needed_rows() -> None:
    mesh, placements, _ = sharding("4", "even", (2, 3, 8, 8))
    x = distribute_tensor(randn((2, 3, 8, 5)), mesh, placements)
    index = _index([0, 0, 7, 1, 6, 6, 6, 2])  # blocks of 2 per rank: [0, 0], [7, 1], [6, 6], [6, 2]
    with count_communication() as log:
        y = x.index_select(2, index)
    # each rank sends every other rank the distinct rows of its block that it owns, once
    me = mesh.get_coordinate()[0]
    sent = sum(row // 2 == me for r in range(4) if r != me for row in set(index[2 * r : 2 * r + 2].tolist()))
    assert log.kinds() == ["all_to_all"] and log.bytes_sent == sent * 2 * 3 * 5 * 4, (log.bytes_sent, sent)
    assert y._spec.axis_sizes[0] == (2, 2, 2, 2)


def _list_index_gradient_keeps_the_split() -> None:
    """``x[:, :, [1, 6]]`` runs as an index_select: its gradient comes back in x's split, not
    replicated at the global shape on every rank (the aten index fallback's)."""
    mesh, placements, _ = sharding("4", "even", (2, 3, 8, 8))
    x = distribute_tensor(randn((2, 3, 8, 5)), mesh, placements).requires_grad_(True)
    y = x[:, :, [1, 6]]
    y.backward(torch.ones_like(y))
    assert x.grad._spec == x._spec, x.grad._spec


def _select_gradient_keeps_the_split() -> None:
    """A select's gradient comes back in x's own (skewed) split with nothing sent, not replicated at
    the global shape on every rank (torch's ``select_backward`` cannot see x's split)."""
    mesh, placements, sizes = sharding("4", "skewed", (2, 3, 7, 5))
    for select in (lambda t: t[:, :, 5], lambda t: t.select(-2, -1), lambda t: torch.select(t, 2, 0), lambda t: t[1, :, 4, 1]):
        x = distribute_tensor(randn((2, 3, 7, 5)), mesh, placements, sizes).requires_grad_(True)
        y = select(x)
        with count_communication() as log:
            y.backward(torch.ones_like(y))
        assert x.grad._spec == x._spec and log.bytes_sent == 0, (x.grad._spec, log.bytes_sent)


def _rows_set_by_a_list_send_nothing() -> None:
    """``u[:, :, [0, -1]] = 0``: each rank writes the rows it owns (DTensor had no rule: it raised)."""
    mesh, placements, sizes = sharding("4", "skewed", (2, 3, 7, 5))
    x = distribute_tensor(randn((2, 3, 7, 5)), mesh, placements, sizes)
    with count_communication() as log:
        x[:, :, [0, -1]] = 0.0
    full = x.full_tensor()
    assert log.calls == 0 and x._spec.axis_sizes == (tuple(sizes[0]),)
    assert bool((full[:, :, [0, 6]] == 0).all()) and bool((full[:, :, 1:6] != 0).all())


def _leading_mask_stays_local() -> None:
    mesh, placements, sizes = sharding("4", "skewed", (1, 1, 11, 5))
    x = distribute_tensor(randn((1, 1, 11, 5)), mesh, placements, sizes)
    with count_communication() as log:
        y = x[x > 0]
    assert "all_to_all" in log.kinds() and sum(r.bytes_sent for r in log.records if r.kind == "all_to_all") == 0
    assert y.placements == (Shard(0),)
    assert list(y._spec.axis_sizes[0]) == [int((t > 0).sum()) for t in x.full_tensor()[0, 0].split(sizes[0], 0)]


def _unsupported_raises() -> None:
    mesh, placements, _ = sharding("4", "even", (2, 3, 8, 8))
    x = distribute_tensor(randn((2, 3, 8, 5)), mesh, placements)
    with pytest.raises(ShardedOpError, match=r"roll.*Shard\(dim=2\).*flattened"):
        x.roll(1)


TRAFFIC_CHECKS = [
    _slicing_sends_nothing,
    _roll_sends_only_crossing_rows,
    _select_broadcasts_one_row,
    _index_select_fetches_needed_rows,
    _list_index_gradient_keeps_the_split,
    _select_gradient_keeps_the_split,
    _rows_set_by_a_list_send_nothing,
    _leading_mask_stays_local,
    _unsupported_raises,
]


@pytest.mark.parametrize("check", TRAFFIC_CHECKS, ids=lambda f: f.__name__)
def test_traffic(check) -> None:
    run_on_ranks(4, check)


def test_slice_plan() -> None:
    assert slice_plan((1, 0, 1, 9), 1, 10, 2) == [(0, 0), (0, 0), (0, 1), (1, 4)]
    assert slice_plan((3, 3), 0, 6, 4) == [(0, 1), (1, 1)]


def test_roll_pieces() -> None:
    # (source rank, first row there, rows, destination rank), in destination order
    pieces = [(p.src, p.start, p.length, p.dst) for p in roll_pieces((3, 3), 1)]
    assert pieces == [(1, 2, 1, 0), (0, 0, 2, 0), (0, 2, 1, 1), (1, 0, 2, 1)]
