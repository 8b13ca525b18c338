"""cumsum, cumprod, logcumsumexp, cummax, cummin and flip over sharded dims equal one device, forward and
backward, and keep the output sharded (DTensor's rules would replicate the whole tensor on every rank):
scans send one row per rank, flip one slab to its mirror rank."""

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


def _ties(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to halves (many equal values, across rank boundaries too), with ``x``'s gradient."""
    return x - x.detach() + (2 * x.detach()).round() / 2


FAMILY: dict[str, Callable] = {
    "cumsum(2)": lambda x: x.cumsum(2),
    "cumsum(-1)": lambda x: torch.cumsum(x, -1),
    "cumsum(0)": lambda x: x.cumsum(0),
    "cumsum(1), an unsharded dim": lambda x: x.cumsum(1),
    "cumsum(2, dtype=float64)": lambda x: x.cumsum(2, dtype=torch.float64),
    "cumsum(2) of ints": lambda x: (3 * x).int().cumsum(2),
    "cumsum(2) of a transposed view": lambda x: x.transpose(2, 3).cumsum(3),
    "cumprod(2)": lambda x: x.cumprod(2),
    "cumprod(3)": lambda x: torch.cumprod(x, 3),
    "cumprod(2) with zeros": lambda x: x.masked_fill(x.abs() < 0.4, 0.0).cumprod(2),
    "cumprod(2) of complex": lambda x: torch.complex(x, 0.5 - x).cumprod(2),
    "logcumsumexp(2)": lambda x: x.logcumsumexp(2),
    "logcumsumexp(-1)": lambda x: torch.logcumsumexp(x, -1),
    "cummax(2)": lambda x: x.cummax(2),
    "cummin(3)": lambda x: torch.cummin(x, 3),
    "cummax(0)": lambda x: x.cummax(0).values,
    "cummax(2) with ties": lambda x: _ties(x).cummax(2),
    "cummin(2) with ties and NaN": lambda x: _ties(x).masked_fill(x > 1.0, float("nan")).cummin(2),
    "flip(2)": lambda x: x.flip(2),
    "flip(2, 3)": lambda x: torch.flip(x, (2, 3)),
    "flip(-1, 0)": lambda x: x.flip(-1, 0),
    "flip(1), an unsharded dim": lambda x: x.flip(1),
    "flip(2) + x, on the original split": lambda x: x.flip(2) + x,
    "flip(2).cumsum(2) * x": lambda x: x.flip(2).cumsum(2) * x,
}


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_scans_and_flip_match_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)


# ----- layout and traffic ----------------------------------------------------------------------------------
def _records(log) -> list[tuple[str, int]]:
    return [(r.kind, r.bytes_sent) for r in log.records]


def _one_axis_traffic() -> dict:
    """(1, 4, 16, 8) float32 sharded [5, 11] on dim 2 of a 2-rank mesh: a row is (1, 4, 1, 8), 128 bytes."""
    mesh = get_mesh((2,))
    x = distribute_tensor(randn((1, 4, 16, 8)), mesh, [Shard(2)], {0: [5, 11]}).requires_grad_(True)
    found = {}
    for name, fn in (
        ("cumsum", lambda t: t.cumsum(2)),
        ("cumprod", lambda t: t.cumprod(2)),
        ("logcumsumexp", lambda t: t.logcumsumexp(2)),
        ("cummax", lambda t: t.cummax(2).values),
        ("cummin", lambda t: t.cummin(2).values),
        ("flip", lambda t: t.flip(2)),
    ):
        with count_communication() as forward:
            y = fn(x)
        with count_communication() as backward:
            y.backward(torch.ones_like(y))
        found[name] = (y._spec.axis_sizes, _records(forward), _records(backward), x.grad._spec == x._spec)
        x.grad = None
    return found


def test_on_two_ranks_scans_send_one_row_and_flip_one_slab() -> None:
    """Forward: cumsum / cumprod / logcumsumexp all-gather one 128-byte row; cummax / cummin the row's values
    and int64 indices together (128 + 256 bytes); flip sends its slab to the mirror rank (5 or 11 rows of
    128 bytes).  Backward: cumsum one all-gather of one row (a reverse scan), cumprod, logcumsumexp, cummax
    and cummin one all-gather of two rows.  Outputs stay sharded as the input (flip: the split reversed)
    and input gradients come back in the input's split."""
    slab = {0: 5 * 128, 1: 11 * 128}
    for rank, found in enumerate(run_on_ranks(2, _one_axis_traffic)):
        mine, mirror = slab[rank], slab[1 - rank]
        expected = {
            "cumsum": ([("all_gather", 128)], [("all_gather", 128)]),
            "cumprod": ([("all_gather", 128)], [("all_gather", 256)]),
            "logcumsumexp": ([("all_gather", 128)], [("all_gather", 256)]),
            "cummax": ([("all_gather", 384)], [("all_gather", 384)]),
            "cummin": ([("all_gather", 384)], [("all_gather", 384)]),
            "flip": ([("p2p", mine)], [("p2p", mirror)]),
        }
        for name, (forward, backward) in expected.items():
            axis_sizes, sent_forward, sent_backward, grad_in_place = found[name]
            assert axis_sizes == (((11, 5),) if name == "flip" else ((5, 11),)), (name, axis_sizes)
            assert sent_forward == forward, (name, rank, sent_forward)
            assert sent_backward == backward, (name, rank, sent_backward)
            assert grad_in_place, name


def _two_axis_traffic() -> dict:
    """(1, 4, 16, 8) float32, H split [5, 11] on mesh axis 0 and W split [3, 5] on mesh axis 1."""
    mesh = get_mesh((2, 2))
    x = distribute_tensor(randn((1, 4, 16, 8)), mesh, [Shard(2), Shard(3)], {0: [5, 11], 1: [3, 5]})
    found = {}
    for name, fn in (
        ("cumsum(2)", lambda t: t.cumsum(2)),
        ("cumsum(3)", lambda t: t.cumsum(3)),
        ("flip(2, 3)", lambda t: t.flip(2, 3)),
    ):
        with count_communication() as forward:
            y = fn(x)
        found[name] = (y._spec.axis_sizes, _records(forward), tuple(x._local_tensor.shape))
    return found


def test_on_a_two_by_two_mesh_a_scan_gathers_rows_along_its_axis_and_flip_swaps_with_the_diagonal() -> None:
    """cumsum(2) gathers a (1, 4, 1, W-slab) row over mesh axis 0, cumsum(3) a (1, 4, H-slab, 1) row over
    axis 1; flip(2, 3) sends the whole slab once, to the rank mirrored on both axes."""
    for found in run_on_ranks(4, _two_axis_traffic):
        _, _, (_, _, rows, columns) = found["cumsum(2)"]
        assert found["cumsum(2)"][:2] == (((5, 11), (3, 5)), [("all_gather", 4 * columns * 4)])
        assert found["cumsum(3)"][:2] == (((5, 11), (3, 5)), [("all_gather", 4 * rows * 4)])
        assert found["flip(2, 3)"][:2] == (((11, 5), (5, 3)), [("p2p", 4 * rows * columns * 4)])


# ----- backward: reverse scans -----------------------------------------------------------------------------
# (mesh shape, placements of a (1, 4, 16, 8) input, split, scanned dims)
BACKWARD_LAYOUTS = {
    "3 ranks, H split [4, 0, 12]": ((3,), [Shard(2)], {0: [4, 0, 12]}, (2, -2)),
    "2x2, H split [5, 11], W [3, 5]": ((2, 2), [Shard(2), Shard(3)], {0: [5, 11], 1: [3, 5]}, (2, -1)),
}


def _backward_traffic(layout: str) -> dict[str, tuple[int, list, list]]:
    """Per scan: what all-gathering one float32 row of this rank's slab across the scanned dim costs (its
    bytes, once per other rank along the dim), what the backward sends, and what a gradient penalty's second
    backward sends (cumsum only)."""
    mesh_shape, placements, sizes, dims = BACKWARD_LAYOUTS[layout]
    x = distribute_tensor(randn((1, 4, 16, 8)), get_mesh(mesh_shape), placements, sizes).requires_grad_(True)
    found = {}
    for dim in dims:
        peers = mesh_shape[placements.index(Shard(dim % 4))] - 1
        row = 4 * math.prod(s for d, s in enumerate(x._local_tensor.shape) if d != dim % 4) * peers
        for name in ("cumsum", "logcumsumexp"):
            y = getattr(x, name)(dim)
            with count_communication() as backward:
                torch.autograd.grad(y, x, torch.ones_like(y))
            double = []
            if name == "cumsum":
                (gy,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
                with count_communication() as second:
                    torch.autograd.grad(gy, x, torch.ones_like(gy))
                double = _records(second)
            found[f"{name}({dim})"] = (row, _records(backward), double)
    return found


@pytest.mark.parametrize("layout", sorted(BACKWARD_LAYOUTS))
def test_backward_of_cumsum_and_logcumsumexp_sends_rows_not_slabs(layout: str) -> None:
    """The backward is a reverse scan: one all-gather of one row per rank for cumsum, of two rows (the
    cotangent's positive and negative parts) for logcumsumexp; an empty shard sends a filler row.  cumsum's
    double backward is a reverse scan of a scan: one row per scan, both ways."""
    for found in run_on_ranks(math.prod(BACKWARD_LAYOUTS[layout][0]), _backward_traffic, layout):
        for name, (row, backward, double) in found.items():
            rows = 2 if name.startswith("logcumsumexp") else 1
            assert backward == [("all_gather", rows * row)], (layout, name, backward)
            if name.startswith("cumsum"):
                assert double == [("all_gather", row)] * 2, (layout, name, double)


def _penalty_grad(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    """d/dx of |d(sum fn(x)^2)/dx|^2: a gradient penalty, which differentiates ``fn``'s backward."""
    (gx,) = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    return x.grad


def _double_backward(layout: str) -> bool:
    mesh_shape, placements, sizes, dims = BACKWARD_LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    t = randn((1, 4, 16, 8))
    for dim in dims:
        for fn in (
            lambda v, d=dim: torch.tanh(v).cumsum(d),
            lambda v, d=dim: torch.cumsum(v * v, d, dtype=torch.float64),
        ):
            x = distribute_tensor(t, mesh, placements, sizes).requires_grad_(True)
            want = _penalty_grad(fn, t.clone().requires_grad_(True))
            torch.testing.assert_close(_penalty_grad(fn, x).full_tensor(), want, rtol=1e-4, atol=1e-4)
        x = distribute_tensor(t, mesh, placements, sizes).requires_grad_(True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            _penalty_grad(lambda v, d=dim: v.logcumsumexp(d), x)
    return True


@pytest.mark.parametrize("layout", sorted(BACKWARD_LAYOUTS))
def test_cumsum_differentiates_twice_and_logcumsumexp_refuses(layout: str) -> None:
    """A gradient penalty through cumsum (with a dtype, on a negative dim too) equals one device's; through
    logcumsumexp it raises (its backward is ``once_differentiable``) rather than being silently wrong."""
    assert all(run_on_ranks(math.prod(BACKWARD_LAYOUTS[layout][0]), _double_backward, layout))


# ----- torch's exact semantics: ties, NaN, ints, low precision ------------------------------------------
def _exact_on_three_ranks() -> bool:
    """Values with many ties and NaNs, split [3, 0, 6] (an empty middle shard): values, indices and
    dtypes equal one device exactly."""
    mesh = get_mesh((3,))
    base = torch.randint(0, 3, (2, 9, 4), generator=torch.Generator().manual_seed(1))
    floats = base.float().masked_fill(base == 2, 1.0)
    floats[0, 4, 1] = floats[1, 0, 2] = floats[1, 7, 2] = float("nan")
    for tensor in (floats, base, base.int(), base.bool()):
        x = distribute_tensor(tensor, mesh, [Shard(1)], {0: [3, 0, 6]})
        for op in (torch.cummax, torch.cummin):
            got, want = op(x, 1), op(tensor, 1)
            assert torch.equal(got.indices.full_tensor(), want.indices), (op, tensor.dtype)
            assert torch.allclose(got.values.full_tensor(), want.values, equal_nan=True), (op, tensor.dtype)
        if tensor.dtype is not torch.float32:
            for kwargs in ({}, {"dtype": torch.int32}):
                got, want = x.cumsum(1, **kwargs), tensor.cumsum(1, **kwargs)
                assert got.dtype == want.dtype and torch.equal(got.full_tensor(), want), (tensor.dtype, kwargs)
            assert torch.equal(x.cumprod(1).full_tensor(), tensor.cumprod(1)), tensor.dtype
    return True


def test_ties_nan_and_integers_follow_torch_exactly() -> None:
    assert all(run_on_ranks(3, _exact_on_three_ranks))


def _low_precision_like_torch() -> bool:
    mesh = get_mesh((3,))
    for dtype in (torch.bfloat16, torch.float16):
        x = randn((2, 3, 7, 5)).to(dtype)
        for fn in (lambda t: t.cumsum(2), lambda t: t.logcumsumexp(2), lambda t: t.cumprod(2)):
            sizes = [{0: [1, 2, 4]}]
            assert_sharded_matches(fn, [x], mesh, [[Shard(2)]], sharding_sizes=sizes, atol=2e-2, rtol=2e-2)
    return True


def test_bfloat16_and_float16_accumulate_in_float32_as_torch_does() -> None:
    """Forward and backward (the reverse scans too) of low precision scans."""
    assert all(run_on_ranks(3, _low_precision_like_torch))


def _partial_input() -> bool:
    """A pending sum (Partial) is reduced first; output and gradient come back without it."""
    mesh = get_mesh((2, 2))
    t = randn((2, 3, 7, 5))
    for fn in (
        lambda v: v.cumsum(2),
        lambda v: v.logcumsumexp(2),
        lambda v: v.cumprod(2),
        lambda v: v.cummax(2).values,
        lambda v: v.flip(2),
    ):
        x = distribute_tensor(t, mesh, [Replicate(), Shard(2)], {1: [2, 5]})
        x = x.redistribute(mesh, [Partial(), Shard(2)]).detach().requires_grad_(True)
        leaf = t.clone().requires_grad_(True)
        y, want = fn(x), fn(leaf)
        assert [type(p) for p in y.placements] == [Replicate, Shard]
        assert torch.allclose(y.full_tensor(), want, atol=1e-5)
        cotangent = randn(tuple(t.shape), seed=3)
        y.backward(distribute_tensor(cotangent, mesh, y.placements, {1: y._spec.axis_sizes[1]}))
        want.backward(cotangent)
        assert torch.allclose(x.grad.full_tensor(), leaf.grad, atol=1e-5)
    return True


def test_partial_inputs_are_reduced_first() -> None:
    assert all(run_on_ranks(4, _partial_input))
