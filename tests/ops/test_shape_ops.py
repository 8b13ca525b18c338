"""squeeze, unsqueeze, flatten, unflatten, permute, transpose, unbind, split, chunk, cat, stack and expand on uneven shards.

Layouts: 1-4 ranks sharding H; a 2x2 mesh sharding H over one axis and W over the other; a 2x2
mesh sharding the batch and H (data x domain).
Splits: even, uneven and skewed explicit sizes with an empty shard.  One rank-function call runs
every function of a family on every split of a layout; a failure names the combination.  The
layout helpers here are shared with ``test_fft.py`` and ``test_indexing.py``.
"""

from __future__ import annotations

import math

from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops._local import ShardedOpError
from physics_dp.ops.shape_ops import cat_split
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

# name -> (mesh shape, tensor dim sharded by each mesh axis)
LAYOUTS = {
    "1": ((1,), (2,)),
    "2": ((2,), (2,)),
    "3": ((3,), (2,)),
    "4": ((4,), (2,)),
    "2x2": ((2, 2), (2, 3)),
    "2x2-NxH": ((2, 2), (0, 2)),
}
# (N, C, H, W) per split kind; "skewed" uses explicit sizes with an empty shard
SHAPES = {"even": (2, 3, 8, 8), "uneven": (2, 3, 7, 5), "skewed": (2, 3, 7, 5)}


def world_of(layout: str) -> int:
    return math.prod(LAYOUTS[layout][0])


def skewed_sizes(extent: int, parts: int) -> list[int]:
    """One empty shard (the first, or the second when there are more than two), one row elsewhere, the rest last."""
    sizes = [1] * parts
    sizes[1 if parts > 2 else 0] = 0
    sizes[-1] = extent - sum(sizes[:-1])
    return sizes


def sharding(layout: str, split: str, shape: tuple[int, ...]):
    """(mesh, placements, sharding sizes or None) for a tensor of ``shape`` on ``layout``."""
    mesh_shape, dims = LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    placements = [Shard(d) for d in dims]
    sizes = None
    if split == "skewed":
        sizes = {axis: skewed_sizes(shape[d], mesh_shape[axis]) for axis, d in enumerate(dims)}
    return mesh, placements, sizes


def randn(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def run_combos(combos: dict[str, Callable[[], None]]) -> list[str]:
    """Run each check; re-raise a failure with the name of its combination."""
    for name, check in combos.items():
        try:
            check()
        except Exception as error:
            raise AssertionError(f"{name}: {type(error).__name__}: {error}") from error
    return list(combos)


def check_family(layout: str, functions: dict[str, Callable]) -> list[str]:
    """Every function of one input (N, C, H, W) on every split of ``layout``."""
    combos = {}
    for split, shape in SHAPES.items():
        mesh, placements, sizes = sharding(layout, split, shape)
        x = randn(shape)
        for name, fn in functions.items():
            combos[f"{name} on {layout} ({split})"] = _one_input_check(fn, x, mesh, placements, sizes)
    return run_combos(combos)


def _one_input_check(fn: Callable, x: torch.Tensor, mesh, placements, sizes) -> Callable[[], None]:
    return lambda: assert_sharded_matches(fn, [x], mesh, [placements], sharding_sizes=[sizes])


# ----- families ------------------------------------------------------------------------------------------
SQUEEZE_FAMILY: dict[str, Callable] = {
    "unsqueeze(1).squeeze(1)": lambda x: x.unsqueeze(1).squeeze(1) * 2,
    "unsqueeze(0).squeeze()": lambda x: x.unsqueeze(0).squeeze(),
    "x[:, :1].squeeze(1)": lambda x: x[:, :1].squeeze(1),
    "unsqueeze(-1).squeeze((0, 4))": lambda x: x[:1].unsqueeze(-1).squeeze((0, 4)),
    "x[:, :, 2:3].squeeze(2)": lambda x: x[:, :, 2:3].squeeze(2),
    "x[..., -1:].squeeze()": lambda x: x[..., -1:].squeeze(),
    "unsqueeze(2)": lambda x: x.unsqueeze(2) + 1,
    "unsqueeze(-1)": lambda x: torch.unsqueeze(x, -1),
    "flatten(0, 1)": lambda x: x.flatten(0, 1),
    "flatten(2)": lambda x: x.flatten(2),
    "unflatten(1, (3, 1))": lambda x: x.unflatten(1, (3, 1)),
}
PERMUTE_FAMILY: dict[str, Callable] = {
    "permute(0, 2, 3, 1)": lambda x: x.permute(0, 2, 3, 1),
    "permute(3, 2, 1, 0)": lambda x: torch.permute(x, (3, 2, 1, 0)) * 3,
    "transpose(2, 3)": lambda x: x.transpose(2, 3),
    "transpose(1, 2).contiguous()": lambda x: x.transpose(1, 2).contiguous().sin(),
    "mT": lambda x: x.mT,
    "movedim(2, 0)": lambda x: torch.movedim(x, 2, 0),
}
SPLIT_FAMILY: dict[str, Callable] = {
    "split(3, 2)": lambda x: x.split(3, 2),
    "split([2, 0, 5], 2)": lambda x: torch.split(x, [2, 0, x.shape[2] - 2], 2),
    "split(2, 3)": lambda x: x.split(2, 3),
    "split(2, 1)": lambda x: x.split(2, 1),
    "split(3, 2)[0]": lambda x: x.split(3, 2)[0] * 2,
    "chunk(3, 2)": lambda x: x.chunk(3, 2),
    "chunk(2, -1)": lambda x: torch.chunk(x, 2, -1),
    "chunk(4, 2)[-1]": lambda x: x.chunk(4, 2)[-1],
    "tensor_split(3, 2)": lambda x: x.tensor_split(3, 2),
    "unbind(1)": lambda x: x.unbind(1),
    "unbind(2)": lambda x: x.unbind(2),
    "unbind(3)": lambda x: torch.unbind(x, 3),
    "unbind(2)[1]": lambda x: x.unbind(2)[1] * 2,
}
CAT_FAMILY: dict[str, Callable] = {
    "cat([x, 2x], 2)": lambda x: torch.cat([x, 2 * x], 2),
    "cat([x, 2x], 3)": lambda x: torch.cat([x, 2 * x], 3),
    "cat([x, 2x], 1)": lambda x: torch.cat([x, 2 * x], 1),
    "cat([x[:, :, 1:], x], 2)": lambda x: torch.cat([x[:, :, 1:], x], 2),
    "cat(x.split(3, 2), 2)": lambda x: torch.cat([p * (i + 1) for i, p in enumerate(x.split(3, 2))], 2),
    "cat(x.chunk(2, 3)[::-1], 3)": lambda x: torch.cat(x.chunk(2, 3)[::-1], 3),
    "cat([x, plain], 2)": lambda x: torch.cat([x, torch.ones(2, 3, 2, x.shape[3])], 2),
    "cat([x, x.flip(2)], -2)": lambda x: torch.cat([x, x.flip(2)], -2),
    "periodic padding by cat([x[:, :, -1:], x, x[:, :, :1]], 2)": lambda x: torch.cat([x[:, :, -1:], x, x[:, :, :1]], 2),
    "stack([x, 2x], 0)": lambda x: torch.stack([x, 2 * x], 0),
    "stack([x, 2x], 2)": lambda x: torch.stack([x, 2 * x], 2),
    "stack([x, 2x], -1)": lambda x: torch.stack([x, 2 * x], -1),
    "stack(x.unbind(2), 2)": lambda x: torch.stack(x.unbind(2), 2),
}
# A size-1 slice of a sharded dim keeps the split (one rank holds the row): expanding it replicates the row.
EXPAND_FAMILY: dict[str, Callable] = {
    "x[:, :, :1].expand_as(x)": lambda x: x[:, :, :1].expand_as(x) * x,
    "x[:, :, -1:].expand(-1, -1, H, -1)": lambda x: x[:, :, -1:].expand(-1, -1, x.shape[2], -1) - x,
    "x[..., 1:2].expand(4, *x.shape)": lambda x: x[..., 1:2].expand(4, *x.shape).sum(0) + x,
    "broadcast_to(x[:, :, 2:3], x.shape)": lambda x: torch.broadcast_to(x[:, :, 2:3], x.shape) + x,
}
# Two inputs of one shape: the first sharded with the split's sizes, the second balanced.
TWO_INPUT_FAMILY: dict[str, Callable] = {
    "cat([x, y], 2)": lambda x, y: torch.cat([x, y], 2),
    "cat([y, x, y], 3)": lambda x, y: torch.cat([y, x, y], 3),
    "cat([x, y], 0)": lambda x, y: torch.cat([x, y], 0),
    "stack([x, y], 2)": lambda x, y: torch.stack([x, y], 2),
    "stack([y, x], 0)": lambda x, y: torch.stack([y, x], 0),
}
FAMILIES = {
    "squeeze": SQUEEZE_FAMILY, "permute": PERMUTE_FAMILY, "split": SPLIT_FAMILY, "cat": CAT_FAMILY, "expand": EXPAND_FAMILY,
}


def _check(layout: str, family: str) -> list[str]:
    return check_family(layout, FAMILIES[family])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shape_op_matches_single_device(layout: str, family: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout, family)[0]
    assert len(checked) == len(SHAPES) * len(FAMILIES[family])


def _check_two_inputs(layout: str) -> list[str]:
    combos = {}
    for split, shape in SHAPES.items():
        mesh, placements, sizes = sharding(layout, split, shape)
        x, y = randn(shape, 0), randn(shape, 1)
        for name, fn in TWO_INPUT_FAMILY.items():
            combos[f"{name} on {layout} ({split} and balanced)"] = _two_input_check(fn, x, y, mesh, placements, sizes)
    return run_combos(combos)


def _two_input_check(fn: Callable, x: torch.Tensor, y: torch.Tensor, mesh, placements, sizes) -> Callable[[], None]:
    return lambda: assert_sharded_matches(fn, [x, y], mesh, [placements, placements], sharding_sizes=[sizes, None])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cat_and_stack_of_differently_split_inputs(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check_two_inputs, layout)[0]
    assert len(checked) == len(SHAPES) * len(TWO_INPUT_FAMILY)


# ----- layouts and communication ----------------------------------------------------------------------------
def _layouts_kept() -> None:
    mesh, placements, sizes = sharding("4", "skewed", (2, 3, 7, 5))
    x = distribute_tensor(randn((2, 1, 7, 5)), mesh, placements, sizes)
    expected = x._spec.axis_sizes[0]
    for name, fn, dim in (
        ("squeeze(1)", lambda t: t.squeeze(1), 1),
        ("unsqueeze(0)", lambda t: t.unsqueeze(0), 3),
        ("permute(2, 0, 1, 3)", lambda t: t.permute(2, 0, 1, 3), 0),
        ("transpose(2, 3)", lambda t: t.transpose(2, 3), 3),
        ("stack([x, x], 1)", lambda t: torch.stack([t, t], 1), 3),
        ("cat([x, x], 3)", lambda t: torch.cat([t, t], 3), 2),
    ):
        with count_communication() as log:
            y = fn(x)
        assert log.calls == 0, f"{name}: {log.kinds()}"
        assert y.placements == (Shard(dim),) and y._spec.axis_sizes[0] == expected, f"{name}: {y._spec}"


def _split_and_cat_send_nothing() -> None:
    mesh, placements, sizes = sharding("4", "skewed", (2, 3, 11, 5))
    x = distribute_tensor(randn((2, 3, 11, 5)), mesh, placements, sizes).requires_grad_(True)
    with count_communication() as log:
        pieces = x.split(4, 2)
        chunks = x.chunk(3, 2)
        joined = torch.cat(pieces, 2)
    assert log.calls == 0, log.kinds()
    assert [p._spec.axis_sizes[0] for p in pieces] == [(1, 0, 1, 2), (0, 0, 0, 4), (0, 0, 0, 3)]
    assert [c._spec for c in chunks] == [p._spec for p in pieces]
    assert joined._spec == x._spec
    cotangents = [
        distribute_tensor(randn(tuple(p.shape), i), mesh, placements, {0: p._spec.axis_sizes[0]})
        for i, p in enumerate(pieces)
    ]
    with count_communication() as log:
        torch.autograd.backward(list(pieces), cotangents)
    assert log.calls == 0, log.kinds()
    assert x.grad._spec.axis_sizes[0] == tuple(sizes[0])


def _unbind_moves_the_axis() -> None:
    mesh, placements, _ = sharding("4", "even", (2, 3, 8, 8))
    x = distribute_tensor(randn((2, 3, 8, 8)), mesh, placements)
    with count_communication() as log:
        rows = x.unbind(2)
    assert log.kinds() == ["all_to_all"], log.kinds()
    assert all(r.placements == (Shard(2),) and r._spec.axis_sizes[0] == (2, 2, 2, 2) for r in rows)
    thin = distribute_tensor(randn((1, 1, 8, 2)), mesh, placements)
    assert thin.unbind(2)[0].placements == (Replicate(),)


def _cat_moves_only_misplaced_rows() -> None:
    mesh, placements, _ = sharding("4", "even", (2, 3, 8, 8))
    x = distribute_tensor(randn((1, 1, 8, 4)), mesh, placements)
    with count_communication() as log:
        y = torch.cat([x, x], 2)
    # each rank holds two rows of each copy; to reach the balanced (4, 4, 4, 4) split, ranks 0-3
    # send 2, 4, 4, 2 rows of 4 floats (the rows already in place stay)
    assert y._spec.axis_sizes[0] == (4, 4, 4, 4)
    rows = (2, 4, 4, 2)[x._spec.coordinate()[0]]
    assert set(log.kinds()) == {"p2p"} and log.bytes_sent == rows * 4 * 4, (log.kinds(), log.bytes_sent)


def _channel_cat_of_alike_split_inputs_is_local() -> None:
    """A U-Net's skip concat: inputs split alike on H, joined on C, with DTensor's propagation forbidden."""
    import physics_dp.ops.shape_ops as shape_ops

    mesh, placements, sizes = sharding("4", "skewed", (2, 3, 11, 5))
    skip, features = randn((2, 3, 11, 5)), randn((2, 2, 11, 5), 1)
    original = shape_ops.propagate_and_run

    def refuse(op, args, kwargs):
        raise AssertionError(f"{op} took DTensor's sharding propagation")

    shape_ops.propagate_and_run = refuse
    try:
        assert_sharded_matches(lambda a, b: torch.cat([a, b], 1) * 2, [skip, features], mesh, [placements] * 2,
                               sharding_sizes=[sizes, sizes])
        a, b = (distribute_tensor(t, mesh, placements, sizes).requires_grad_(True) for t in (skip, features))
        with count_communication() as log:
            joined = torch.cat([a, b], 1)
            joined.backward(torch.ones_like(joined))
        assert log.calls == 0, log.kinds()
        assert joined._spec.axis_sizes == a._spec.axis_sizes and joined.placements == a.placements
    finally:
        shape_ops.propagate_and_run = original


def _cat_gradients_come_back_in_each_input_layout() -> None:
    """Periodic padding by cat on 2 ranks: each edge slice's gradient row goes home before
    ``slice_backward`` pads it (one (2, 4, 1, 8) float32 row, 256 bytes, each way) instead of the
    padded whole slab after; ``x.grad`` keeps x's own split (it was (16, 0) for cat([x, 3x]))."""
    mesh = get_mesh((2,))
    x = distribute_tensor(randn((2, 4, 16, 8)), mesh, [Shard(2)]).requires_grad_(True)
    padded = torch.cat([x[:, :, -1:], x, x[:, :, :1]], 2)
    with count_communication() as log:
        padded.backward(torch.ones_like(padded))
    assert log.bytes_sent == 256, log.records
    x.grad = None
    doubled = torch.cat([x, 3 * x], 2)
    doubled.backward(torch.ones_like(doubled))
    assert x.grad._spec == x._spec, x.grad._spec


def _cat_over_two_axes_raises() -> None:
    mesh = get_mesh((2, 2))
    a = distribute_tensor(randn((2, 3, 4, 4)), mesh, [Shard(2), Replicate()])
    b = distribute_tensor(randn((2, 3, 4, 4)), mesh, [Replicate(), Shard(2)])
    with pytest.raises(ShardedOpError, match="cat.*different mesh axes"):
        torch.cat([a, b], 2)


def _single_checks() -> None:
    _layouts_kept()
    _split_and_cat_send_nothing()
    _unbind_moves_the_axis()
    _cat_moves_only_misplaced_rows()
    _channel_cat_of_alike_split_inputs_is_local()


@pytest.mark.parametrize("check", [_single_checks, _cat_over_two_axes_raises], ids=lambda f: f.__name__)
def test_layouts_and_traffic(check) -> None:
    run_on_ranks(4, check)


def test_cat_gradients_come_back_in_each_input_layout() -> None:
    run_on_ranks(2, _cat_gradients_come_back_in_each_input_layout)


def test_cat_split() -> None:
    # split pieces rejoin in place; a replicated filler adapts; interleaved ranks fall back to balanced
    assert cat_split([(0, 3, (3, 0, 0)), (3, 2, (0, 2, 0)), (5, 2, (0, 0, 2))], 7, 3) == [3, 2, 2]
    assert cat_split([(0, 3, (3, 0, 0)), (3, 2, None), (5, 2, (0, 0, 2))], 7, 3) == [3, 2, 2]
    assert cat_split([(0, 4, (2, 2)), (4, 4, (2, 2))], 8, 2) == [4, 4]
    assert cat_split([(0, 0, (0, 0)), (0, 5, (0, 5))], 5, 2) == [0, 5]


def _pixel_unshuffle_of_a_split_cutting_blocks() -> bool:
    mesh = get_mesh((2,))
    fn = lambda x: torch.nn.functional.pixel_unshuffle(x, 2)  # noqa: E731
    assert_sharded_matches(fn, [randn((1, 2, 6, 4))], mesh, [[Shard(2)]], sharding_sizes=[{0: [3, 3]}])
    return True


def test_pixel_unshuffle_of_a_split_cutting_blocks():
    """H = 6 as [3, 3] cuts 2 x 2 blocks: the slabs move to whole blocks ([4, 2]) first (torch's
    kernel raised on each slab of 3 rows although the grid divides)."""
    assert all(run_on_ranks(2, _pixel_unshuffle_of_a_split_cutting_blocks))
