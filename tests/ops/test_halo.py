"""Halo exchange and F.pad on sharded dims: exact windows, gradients back to their owners, exact bytes.

References come from torch itself: a rank's window is a slice of ``F.pad`` of the global tensor,
and the rows it may receive are read off ``F.pad`` of an index tensor, so the byte counts are
checked against an accounting that shares no code with the planner.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops.halo import (
    CONSTANT, gather_window, halo_exchange, halo_exchange_nd, plan_window, scatter_window, uniform_windows,
)
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

LAYOUTS = [(1,), (2,), (3,), (4,), (2, 2)]
SPLITS = ["even", "uneven", "skewed"]
EXTENTS = {"even": (12, 8), "uneven": (13, 7), "skewed": (13, 7)}  # (H, W)
# Small, empty and one-row shards: halos reach past neighbours, edges fall on empty ranks.
SKEWED_H = {1: lambda n: [n], 2: lambda n: [1, n - 1], 3: lambda n: [1, 0, n - 1], 4: lambda n: [n - 4, 1, 3, 0]}
SKEWED_W = {2: lambda n: [0, n]}
# (mode, value, (left, right) of H, (left, right) of W)
HALO_COMBOS = [
    ("constant", 0.0, (1, 1), (1, 1)),
    ("constant", 1.5, (0, 3), (2, 0)),
    ("constant", 0.0, (0, 0), (0, 0)),
    ("constant", -2.0, (5, 4), (3, 3)),
    ("reflect", None, (1, 1), (1, 1)),
    ("reflect", None, (3, 0), (0, 2)),
    ("reflect", None, (6, 5), (4, 6)),
    ("replicate", None, (2, 2), (1, 3)),
    ("replicate", None, (0, 7), (5, 0)),
    ("circular", None, (1, 1), (1, 1)),
    ("circular", None, (4, 2), (0, 3)),
    ("circular", None, (12, 1), (7, 7)),
]


def world_of(mesh_shape: tuple[int, ...]) -> int:
    return math.prod(mesh_shape)


@contextlib.contextmanager
def window_gather_forbidden(module: Any, name: str) -> Iterator[None]:
    """Inside, ``module.name`` (a path's window gather, a copy of the slab) raises instead of running."""
    original = getattr(module, name)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the slab was gathered into a window")

    setattr(module, name, refuse)
    try:
        yield
    finally:
        setattr(module, name, original)


def split_sizes(kind: str, extents: tuple[int, int], mesh) -> list[list[int]]:
    """Per mesh axis, the H (axis 0) and W (axis 1) split of ``kind``; balanced unless skewed."""
    out = []
    for axis in range(mesh.ndim):
        n, parts = extents[axis], mesh.size(axis)
        if kind == "skewed":
            out.append((SKEWED_H if axis == 0 else SKEWED_W)[parts](n))
        else:
            base, extra = divmod(n, parts)
            out.append([base + (i < extra) for i in range(parts)])
    return out


def _field(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _slab_bounds(sizes, coordinate):
    start = sum(sizes[:coordinate])
    return start, start + sizes[coordinate]


# ----- the planner, simulated for every rank in one process ------------------------------------
def _simulate(sizes, windows, mode):
    """Assemble every rank's window from the plans alone; compare with F.pad of an index row."""
    extent = sum(sizes)
    rows = torch.arange(extent, dtype=torch.float64)
    plans = [plan_window(sizes, windows, r, mode) for r in range(len(sizes))]
    reach = max(max(0, -lo, hi - extent) for lo, hi in windows)
    if reach > {"reflect": extent - 1, "circular": extent}.get(mode, reach):
        return False  # beyond what F.pad (the reference) defines
    kwargs = {"value": -1.0} if mode == "constant" else {}
    padded = F.pad(rows.view(1, 1, -1), (reach, reach), mode=mode, **kwargs).view(-1)
    for r, plan in enumerate(plans):
        start, stop = _slab_bounds(sizes, r)
        pieces = {r: rows[start:stop], CONSTANT: torch.tensor([-1.0], dtype=torch.float64)}
        for peer, count in plan.receives:
            sent = dict(plans[peer].sends)[r]
            assert len(sent) == count
            peer_start, peer_stop = _slab_bounds(sizes, peer)
            pieces[peer] = rows[peer_start:peer_stop][list(sent)]
        parts = []
        for s in plan.segments:
            if s.step == 1:
                parts.append(pieces[s.source][s.start : s.start + s.length])
            elif s.step == -1:
                parts.append(pieces[s.source][s.last : s.start + 1].flip(0))
            else:
                parts.append(pieces[s.source][s.start : s.start + 1].expand(s.length))
        got = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)
        lo, hi = windows[r]
        want = padded[lo + reach : hi + reach]
        assert torch.equal(got, want), f"sizes={sizes} windows={windows} mode={mode} rank={r}: {got} != {want}"
    return True


def test_planner_assembles_every_window_exactly():
    rng = random.Random(0)
    checked = 0
    for _ in range(800):
        sizes = tuple(rng.randint(0, 5) for _ in range(rng.randint(1, 4)))
        extent = sum(sizes)
        if extent == 0:
            continue
        mode = rng.choice(["constant", "reflect", "replicate", "circular"])
        reach = {"reflect": extent - 1, "circular": extent}.get(mode, 6)
        windows, start = [], 0
        for size in sizes:  # per-rank windows, trimmed (negative widths) or widened
            lo = start - rng.randint(-1, reach)
            windows.append((lo, max(lo, start + size + rng.randint(-1, reach))))
            start += size
        checked += _simulate(sizes, tuple(windows), mode)
    assert checked > 500


def test_planner_sends_only_needed_rows():
    # 4 ranks of 3 rows, width 1: each interior rank sends one row to each side.
    sizes = (3, 3, 3, 3)
    windows = uniform_windows(sizes, 1, 1)
    assert dict(plan_window(sizes, windows, 1, "constant").sends) == {0: (0,), 2: (2,)}
    assert plan_window(sizes, windows, 0, "constant").receives == ((1, 1),)
    # circular: the first and last ranks exchange.
    assert dict(plan_window(sizes, windows, 0, "circular").sends) == {1: (2,), 3: (0,)}
    # a width of 4 past one-row shards reaches two ranks away.
    sizes = (1, 1, 5)
    plan = plan_window(sizes, uniform_windows(sizes, 0, 4), 0, "constant")
    assert plan.receives == ((1, 1), (2, 3))
    # reflect asks for a reflected row once even when two window rows use it.
    plan = plan_window((1, 4), uniform_windows((1, 4), 2, 1), 0, "reflect")
    assert plan.receives == ((1, 2),)


def test_widths_exceeding_one_reflection_raise():
    with pytest.raises(ValueError, match="reflect"):
        plan_window((2, 2), uniform_windows((2, 2), 4, 0), 0, "reflect")


# ----- distributed halo exchange ---------------------------------------------------------------
def _global_window(x, mode, value, h_widths, w_widths, sharded_w):
    """F.pad of the global tensor by the halo widths (W padded only where W is sharded)."""
    pads = (*(w_widths if sharded_w else (0, 0)), *h_widths)
    kwargs = {"value": value} if mode == "constant" else {}
    return F.pad(x, pads, mode=mode, **kwargs)


def _rank_window_slices(sizes_per_axis, coordinate, h_widths, w_widths, w_extent):
    """The slice of the globally padded tensor that rank ``coordinate``'s window is."""
    h0, h1 = _slab_bounds(sizes_per_axis[0], coordinate[0])
    hs = slice(h0, h1 + h_widths[0] + h_widths[1])
    if len(sizes_per_axis) == 1:
        return hs, slice(0, w_extent)
    w0, w1 = _slab_bounds(sizes_per_axis[1], coordinate[1])
    return hs, slice(w0, w1 + w_widths[0] + w_widths[1])


def _expected_bytes(sizes_per_axis, coordinate, mode, h_widths, w_widths, other_numel_h, h_window, nc):
    """Bytes this rank sends: per peer, the distinct rows of the peer's window that this rank owns."""
    total = 0
    for axis, widths in enumerate((h_widths, w_widths)[: len(sizes_per_axis)]):
        sizes, me = sizes_per_axis[axis], coordinate[axis]
        extent = sum(sizes)
        kwargs = {"value": -1.0} if mode == "constant" else {}
        index = F.pad(torch.arange(extent, dtype=torch.float64).view(1, 1, -1), widths, mode=mode, **kwargs).view(-1)
        lo, hi = _slab_bounds(sizes, me)
        rows = 0
        for peer in range(len(sizes)):
            if peer != me:
                p0, p1 = _slab_bounds(sizes, peer)
                window = index[p0 : p1 + widths[0] + widths[1]]
                rows += len({int(r) for r in window.tolist() if lo <= r < hi})
        # the H exchange moves rows of N*C*W_local; the W exchange columns of N*C*H_window
        total += rows * (other_numel_h if axis == 0 else nc * h_window) * 4
    return total


def _halo_cases(mesh_shape, split):
    mesh = get_mesh(mesh_shape)
    coordinate = mesh.get_coordinate()
    h, w = EXTENTS[split]
    x = _field((2, 3, h, w))
    sizes = split_sizes(split, (h, w), mesh)
    placements = [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]
    xs = distribute_tensor(x, mesh, placements, dict(enumerate(sizes)))
    sharded_w = mesh.ndim == 2
    checked = 0
    for index, (mode, value, hw, ww) in enumerate(HALO_COMBOS):
        combo = f"mode={mode} value={value} H widths={hw} W widths={ww} sizes={sizes} coordinate={coordinate}"
        reference = x.clone().requires_grad_(True)
        padded = _global_window(reference, mode, value, hw, ww, sharded_w)
        local = xs.to_local().detach().clone().requires_grad_(True)
        with count_communication() as forward_log:
            if sharded_w:
                window = halo_exchange_nd(local, xs._spec, {2: hw, 3: ww}, mode=mode, value=value or 0.0)
            else:
                window = halo_exchange(local, xs._spec, 0, *hw, mode=mode, value=value or 0.0)
        # every rank's cotangent, so each rank can form the global reference gradient itself
        loss = 0
        for c in _all_coordinates(mesh):
            hs, ws = _rank_window_slices(sizes, c, hw, ww, w)
            cotangent = _field(padded[:, :, hs, ws].shape, seed=1000 * index + sum(c) * 10 + c[0])
            loss = loss + (padded[:, :, hs, ws] * cotangent).sum()
            if tuple(c) == tuple(coordinate):
                mine, my_slices = cotangent, (hs, ws)
        loss.backward()
        want = padded[:, :, my_slices[0], my_slices[1]].detach()
        assert torch.equal(window, want), f"window differs: {combo}"
        with count_communication() as backward_log:
            window.backward(mine)
        h0, h1 = _slab_bounds(sizes[0], coordinate[0])
        w0, w1 = _slab_bounds(sizes[1], coordinate[1]) if sharded_w else (0, w)
        torch.testing.assert_close(local.grad, reference.grad[:, :, h0:h1, w0:w1], msg=lambda m: f"{combo}: {m}")
        nc = x.shape[0] * x.shape[1]
        expected = _expected_bytes(sizes, coordinate, mode, hw, ww, nc * local.shape[3], window.shape[2], nc)
        assert set(forward_log.kinds()) <= {"p2p"}, f"{combo}: {forward_log.kinds()}"
        assert forward_log.bytes_sent == expected, f"{combo}: sent {forward_log.bytes_sent} bytes, expected {expected}"
        assert backward_log.bytes_sent == _bytes_received(sizes, coordinate, mode, hw, ww, nc, local, window, w), combo
        checked += 1
    return checked


def _bytes_received(sizes, coordinate, mode, hw, ww, nc, local, window, w):
    """Backward returns each received row's gradient to its owner: bytes = rows received."""
    total = 0
    for axis, widths in enumerate((hw, ww)[: len(sizes)]):
        axis_sizes, me = sizes[axis], coordinate[axis]
        extent = sum(axis_sizes)
        kwargs = {"value": -1.0} if mode == "constant" else {}
        index = F.pad(torch.arange(extent, dtype=torch.float64).view(1, 1, -1), widths, mode=mode, **kwargs).view(-1)
        lo, hi = _slab_bounds(axis_sizes, me)
        mine = index[lo : hi + widths[0] + widths[1]].tolist()
        rows = len({int(r) for r in mine if r >= 0 and not lo <= r < hi})
        total += rows * (nc * local.shape[3] if axis == 0 else nc * window.shape[2]) * 4
    return total


def _all_coordinates(mesh):
    if mesh.ndim == 1:
        return [(c,) for c in range(mesh.size(0))]
    return [(a, b) for a in range(mesh.size(0)) for b in range(mesh.size(1))]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_halo_exchange_windows_grads_and_bytes(mesh_shape, split):
    checked = run_on_ranks(world_of(mesh_shape), _halo_cases, mesh_shape, split)
    assert checked == [len(HALO_COMBOS)] * world_of(mesh_shape)


def _two_rank_example():
    """2 ranks, (2, 3, 8, 5) split 4 + 4 over H, width 1: one row of 2*3*5 floats each way."""
    mesh = get_mesh((2,))
    xs = distribute_tensor(_field((2, 3, 8, 5)), mesh, [Shard(2)])
    local = xs.to_local().clone().requires_grad_(True)
    with count_communication() as log:
        window = halo_exchange(local, xs._spec, 0, 1, 1)
    with count_communication() as back:
        window.backward(torch.ones_like(window))
    return [(r.kind, r.bytes_sent) for r in log.records], [(r.kind, r.bytes_sent) for r in back.records]


def test_halo_bytes_two_ranks_example():
    for forward, backward in run_on_ranks(2, _two_rank_example):
        assert forward == [("p2p", 2 * 3 * 5 * 4)]
        assert backward == [("p2p", 2 * 3 * 5 * 4)]


def _per_rank_windows_and_local_dims():
    """Arbitrary per-rank windows (a strided stencil's) and a dim held whole, via gather_window."""
    mesh = get_mesh((3,))
    x = _field((2, 10, 4))
    xs = distribute_tensor(x, mesh, [Shard(1)], {0: [2, 5, 3]})
    windows = ((-1, 3), (4, 6), (5, 12))  # rank 1 keeps only part of its slab, rank 2 reaches back
    me = mesh.get_coordinate()[0]
    got = gather_window(xs.to_local(), 1, (2, 5, 3), windows, group=mesh.get_group(0), mode="replicate")
    padded = F.pad(x.unsqueeze(0), (0, 0, 1, 2), mode="replicate").squeeze(0)
    lo, hi = windows[me]
    assert torch.equal(got, padded[:, lo + 1 : hi + 1])
    whole = gather_window(x, 2, (4,), ((-2, 5),), mode="circular")
    assert torch.equal(whole, F.pad(x, (2, 1), mode="circular"))
    return True


def test_gather_window_per_rank_windows_and_whole_dims():
    assert all(run_on_ranks(3, _per_rank_windows_and_local_dims))


def _adjoint_products() -> tuple[float, float]:
    """<gather(x), y> and <x, scatter(y)> on this rank, for windows past neighbours and the edges."""
    import torch.distributed as dist

    sizes, windows = (2, 5, 3), ((-2, 6), (1, 1), (4, 13))  # an empty window, rows beyond both edges
    me = dist.get_rank()
    x = torch.randn(3, sizes[me], 2, generator=torch.Generator().manual_seed(me), dtype=torch.float64)
    lo, hi = windows[me]
    y = torch.randn(3, hi - lo, 2, generator=torch.Generator().manual_seed(10 + me), dtype=torch.float64)
    group = get_mesh((3,)).get_group(0)
    gathered = gather_window(x, 1, sizes, windows, group=group)
    scattered = scatter_window(y, 1, sizes, windows, group=group)
    return float((gathered * y).sum()), float((x * scattered).sum())


def test_scatter_window_is_the_adjoint_of_the_gather():
    """Summed over the ranks, <gather(x), y> = <x, scatter(y)>: each window row's values reach the
    owner of the row and rows beyond the grid are dropped."""
    products = run_on_ranks(3, _adjoint_products)
    assert math.isclose(sum(p[0] for p in products), sum(p[1] for p in products), rel_tol=1e-12)


# ----- F.pad on sharded dims (what nn.Conv*d calls for padding_mode != 'zeros') -----------------
PAD_COMBOS = [
    # (name, input shape, pad, mode, value); dims 2 (and 3 on 2-D meshes) are sharded
    ("const_sym", (2, 3, 13, 7), (1, 1, 2, 2), "constant", 0.0),
    ("const_value_one_sided", (2, 3, 13, 7), (0, 3, 4, 0), "constant", 2.5),
    ("const_trim", (2, 3, 13, 7), (-1, 2, -3, -2), "constant", 0.0),
    ("const_far", (2, 3, 13, 7), (5, 4, 9, 7), "constant", -1.0),
    ("reflect_sym", (2, 3, 13, 7), (1, 1, 1, 1), "reflect", None),
    ("reflect_asym", (2, 3, 13, 7), (0, 3, 4, 2), "reflect", None),
    ("reflect_deep", (2, 3, 13, 7), (6, 5, 11, 10), "reflect", None),
    ("replicate_asym", (2, 3, 13, 7), (2, 0, 0, 5), "replicate", None),
    ("circular_sym", (2, 3, 13, 7), (1, 1, 1, 1), "circular", None),
    ("circular_wrap", (2, 3, 13, 7), (7, 3, 12, 2), "circular", None),
    ("unsharded_w_only", (2, 3, 13, 7), (2, 1, 0, 0), "reflect", None),
    ("reflect_3d", (1, 2, 13, 7, 4), (1, 2, 2, 1, 3, 3), "reflect", None),
    ("replicate_3d", (1, 2, 13, 7, 4), (0, 1, 1, 0, 2, 5), "replicate", None),
    ("circular_3d", (1, 2, 13, 7, 4), (1, 1, 3, 2, 4, 1), "circular", None),
]


def _pad_cases(mesh_shape, split):
    mesh = get_mesh(mesh_shape)
    count = 0
    for name, shape, pad, mode, value in PAD_COMBOS:
        extents = (shape[2], shape[3])
        if split == "even":
            shape = (shape[0], shape[1], 12, 8, *shape[4:])
            extents = (12, 8)
        x = _field(shape, seed=count)
        sizes = split_sizes(split, extents, mesh)
        placements = [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]
        kwargs = {"mode": mode} if value is None else {"mode": mode, "value": value}

        def fn(t, pad=pad, kwargs=kwargs):
            return F.pad(t, pad, **kwargs)

        try:
            report = assert_sharded_matches(fn, [x], mesh, [placements], sharding_sizes=[dict(enumerate(sizes))])
        except (AssertionError, RuntimeError, ValueError) as error:
            raise AssertionError(f"F.pad {name} shape={shape} pad={pad} sizes={sizes}: {error}") from error
        assert report.output_placements == [tuple(placements)], name
        count += 1
    return count


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_pad_matches_single_device(mesh_shape, split):
    assert run_on_ranks(world_of(mesh_shape), _pad_cases, mesh_shape, split) == [len(PAD_COMBOS)] * world_of(mesh_shape)


def _pad_sends_only_edge_rows():
    """Reflect/replicate pads need no neighbour rows (edges are local); circular swaps edge rows."""
    mesh = get_mesh((3,))
    xs = distribute_tensor(_field((1, 2, 9, 4)), mesh, [Shard(2)])
    out = {}
    for mode in ("reflect", "replicate", "circular", "constant"):
        with count_communication() as log:
            F.pad(xs, (1, 1, 2, 1), mode=mode)
        out[mode] = log.bytes_sent
    return mesh.get_coordinate()[0], out


def test_pad_bytes():
    row = 1 * 2 * (4 + 2) * 4  # N*C*W floats, W already padded (F.pad pads the last dim first)
    for coordinate, sent in run_on_ranks(3, _pad_sends_only_edge_rows):
        assert sent["reflect"] == sent["replicate"] == sent["constant"] == 0
        # circular: rank 0 sends its first row to rank 2 (right pad 1), rank 2 its last two to rank 0
        assert sent["circular"] == {0: row, 1: 0, 2: 2 * row}[coordinate]
