"""Halo exchange: give each rank the rows of a sharded dim that its stencil needs beyond its slab.

The primitive is a *window gather*: every rank asks for a range ``[lo, hi)`` of global rows of
one sharded dim (its ranges may differ, e.g. a strided convolution's exact output split), rows
outside ``[0, extent)`` are filled by a global edge mode (constant, reflect, replicate,
circular), and each rank sends each peer exactly the rows that peer's window takes from it, by
point-to-point messages.  A window may reach past a neighbour's shard (small or empty shards),
so peers need not be adjacent.  A plan depends only on the split, the windows and the mode,
never on data, so every rank derives its peers' needs itself and plans are cached.

The backward pass sends each halo row's gradient back to the rank that owns the row, where it
is added to the slab gradient.  Under a double backward (``create_graph=True``) that backward is
itself a differentiable function whose backward is the gather again.  A 2-D decomposition exchanges one sharded dim after the other;
the second exchange carries the first one's halo rows, so corners are right.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..distributed.tracing import is_tracing
from ..shard_tensor import ShardTensorSpec
from ..shard_tensor.spec import channels_last_order, in_memory_order
from .grad_sums import creating_graph

__all__ = [
    "EDGE_MODES",
    "CONSTANT",
    "Window",
    "Segment",
    "WindowPlan",
    "plan_window",
    "uniform_windows",
    "gather_window",
    "scatter_window",
    "halo_exchange",
    "halo_exchange_nd",
    "with_extent",
    "start_edge_exchange",
    "exchange_boundary_rows",
    "received_rows",
]

EDGE_MODES = ("constant", "reflect", "replicate", "circular")
CONSTANT = -1  # the source of rows filled with the constant value

Window = tuple[int, int]


@dataclass(frozen=True)
class Segment:
    """A run of window rows taken from one piece: rows ``start, start + step, ...`` (``length`` of them).

    The piece is this rank's slab (``source`` = this rank), the rows received from peer
    ``source``, or the constant row (``source`` = ``CONSTANT``).  ``step`` is 1 (ascending),
    -1 (reflected) or 0 (one row repeated: replicate, constant).
    """

    source: int
    start: int
    length: int
    step: int

    @property
    def last(self) -> int:
        return self.start + self.step * (self.length - 1)


@dataclass(frozen=True)
class WindowPlan:
    """What one rank sends, receives and assembles so that it holds its window of a sharded dim."""

    me: int
    sends: tuple[tuple[int, tuple[int, ...]], ...]  # (peer, slab rows the peer takes from me)
    receives: tuple[tuple[int, int], ...]  # (peer, number of distinct rows I take from it)
    segments: tuple[Segment, ...]


# ----- planning (pure functions of the split; identical on every rank) ------------------------
def uniform_windows(sizes: Sequence[int], left: int, right: int) -> tuple[Window, ...]:
    """Every rank's slab widened by ``left`` rows before and ``right`` rows after it."""
    windows, start = [], 0
    for size in sizes:
        windows.append((start - left, start + size + right))
        start += size
    return tuple(windows)


def _source_row(row: int, extent: int, mode: str) -> int | None:
    """The global row whose value window row ``row`` takes; ``None`` for the constant."""
    if 0 <= row < extent:
        return row
    if mode == "constant":
        return None
    if extent == 0:
        raise ValueError(f"{mode} edge mode needs rows to copy, but the sharded dim is empty")
    if mode == "replicate":
        return min(max(row, 0), extent - 1)
    if mode == "circular":
        return row % extent
    reflected = -row if row < 0 else 2 * (extent - 1) - row
    if not 0 <= reflected < extent:
        raise ValueError(f"reflect edge mode reaches row {row}, beyond one reflection of an extent of {extent}")
    return reflected


def _window_sources(
    window: Window, rank: int, starts: Sequence[int], sizes: Sequence[int], mode: str
) -> list[tuple[int, int]]:
    """(owner or CONSTANT, global row) of every row of ``rank``'s window outside its own slab, in order.

    Rows inside the rank's slab are its own and are left out (see :func:`_own_range`).
    """
    lo, hi = window
    start, size = starts[rank], sizes[rank]
    extent = starts[-1] + sizes[-1]
    rows = [*range(lo, min(hi, start)), *range(max(lo, start + size), hi)]
    out = []
    for row in rows:
        source = _source_row(row, extent, mode)
        owner = CONSTANT if source is None else bisect.bisect_right(starts, source) - 1
        out.append((owner, 0 if source is None else source))
    return out


def _own_range(window: Window, start: int, size: int) -> tuple[int, int]:
    """The part of a window inside the rank's own slab, as global rows [a, b)."""
    a, b = max(window[0], start), min(window[1], start + size)
    return a, max(a, b)


def _merge(segments: list[Segment], new: Segment) -> None:
    """Append ``new``, extending the last segment when it continues it with one step."""
    if segments:
        last = segments[-1]
        step = new.start - last.last
        if (
            last.source == new.source
            and step in (-1, 0, 1)
            and (last.length == 1 or last.step == step)
            and (new.length == 1 or new.step == step)
        ):
            segments[-1] = Segment(last.source, last.start, last.length + new.length, step)
            return
    segments.append(new)


def _sends(
    starts: Sequence[int], sizes: Sequence[int], windows: Sequence[Window], me: int, mode: str
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(peer, local rows) for every peer whose window takes rows from ``me``'s slab."""
    sends = []
    for peer, window in enumerate(windows):
        if peer != me:
            rows = sorted({row for owner, row in _window_sources(window, peer, starts, sizes, mode) if owner == me})
            if rows:
                sends.append((peer, tuple(row - starts[me] for row in rows)))
    return tuple(sends)


def _assembly(
    starts: Sequence[int], sizes: Sequence[int], window: Window, me: int, mode: str
) -> tuple[tuple[tuple[int, int], ...], tuple[Segment, ...]]:
    """(peer, rows received) and the segments that build ``me``'s window from its pieces."""
    mine = _window_sources(window, me, starts, sizes, mode)
    taken: dict[int, set[int]] = {}
    for owner, row in mine:
        if owner not in (me, CONSTANT):
            taken.setdefault(owner, set()).add(row)
    position = {owner: {row: i for i, row in enumerate(sorted(rows))} for owner, rows in taken.items()}

    def segment(owner: int, row: int) -> Segment:
        index = 0 if owner == CONSTANT else row - starts[me] if owner == me else position[owner][row]
        return Segment(owner, index, 1, 1)

    own_lo, own_hi = _own_range(window, starts[me], sizes[me])
    before = max(0, min(window[1], starts[me]) - window[0])
    segments: list[Segment] = []
    for owner, row in mine[:before]:
        _merge(segments, segment(owner, row))
    if own_hi > own_lo:
        _merge(segments, Segment(me, own_lo - starts[me], own_hi - own_lo, 1))
    for owner, row in mine[before:]:
        _merge(segments, segment(owner, row))
    receives = tuple((owner, len(rows)) for owner, rows in sorted(taken.items()))
    return receives, tuple(segments)


@functools.lru_cache(maxsize=4096)
def plan_window(sizes: tuple[int, ...], windows: tuple[Window, ...], me: int, mode: str) -> WindowPlan:
    """The plan for rank ``me`` when rank ``r`` of the group needs global rows ``windows[r]``."""
    if mode not in EDGE_MODES:
        raise ValueError(f"unknown edge mode {mode!r}; expected one of {EDGE_MODES}")
    if len(windows) != len(sizes) or any(hi < lo for lo, hi in windows):
        raise ValueError(f"need one window (lo <= hi) per rank for sizes {sizes}, got {windows}")
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    receives, segments = _assembly(starts, sizes, windows[me], me, mode)
    return WindowPlan(me, _sends(starts, sizes, windows, me, mode), receives, segments)


# ----- execution ----------------------------------------------------------------------------
def _rows(tensor: torch.Tensor, dim: int, rows: Sequence[int]) -> torch.Tensor:
    """``tensor``'s rows along ``dim`` (a narrow for a contiguous run, else a gather)."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return tensor.narrow(dim, rows[0], len(rows))
    return tensor.index_select(dim, torch.tensor(rows, device=tensor.device))


def _add_rows(target: torch.Tensor, dim: int, rows: Sequence[int], values: torch.Tensor) -> None:
    if rows[-1] - rows[0] + 1 == len(rows):
        target.narrow(dim, rows[0], len(rows)).add_(values)
    else:
        target.index_add_(dim, torch.tensor(rows, device=target.device), values)


def with_extent(shape: Sequence[int], dim: int, extent: int) -> list[int]:
    """``shape`` with dim ``dim`` of extent ``extent`` (a halo's, a strip's, a message's shape)."""
    shape = list(shape)
    shape[dim] = extent
    return shape


def start_edge_exchange(
    to_prev: torch.Tensor | None,
    to_next: torch.Tensor | None,
    received_shape: Sequence[int],
    from_prev: int,
    from_next: int,
    dim: int,
    group: ProcessGroup,
    anchor: torch.Tensor,
) -> collectives.PendingExchange:
    """Start sending ``to_prev`` to the previous rank of ``group`` and ``to_next`` to the next (None or
    no rows: nothing), and receiving ``from_prev`` and ``from_next`` rows of ``received_shape`` along
    ``dim`` (0: nothing expected).  ``anchor`` gives the dtype and device.

    Every rank passes counts that mirror its neighbours' (they come from one shared geometry).
    """
    me = collectives.group_rank(group)
    sends, recv_shapes = {}, {}
    for peer, piece, count in ((me - 1, to_prev, from_prev), (me + 1, to_next, from_next)):
        if piece is not None and piece.shape[dim]:
            sends[peer] = piece
        if count:
            recv_shapes[peer] = with_extent(received_shape, dim, count)
    return collectives.start_exchange(sends, recv_shapes, group, dtype=anchor.dtype, device=anchor.device, anchor=anchor)


def exchange_boundary_rows(
    local: torch.Tensor, dim: int, group: ProcessGroup, to_prev: int, to_next: int, from_prev: int, from_next: int
) -> collectives.PendingExchange:
    """:func:`start_edge_exchange` of ``local``'s first ``to_prev`` and last ``to_next`` rows."""
    extent = local.shape[dim]
    first, last = local.narrow(dim, 0, to_prev), local.narrow(dim, extent - to_next, to_next)
    return start_edge_exchange(first, last, local.shape, from_prev, from_next, dim, group, local)


def received_rows(pending: collectives.PendingExchange, group: ProcessGroup) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows from the previous rank, rows from the next rank), None where none were expected."""
    received = pending.wait()
    me = collectives.group_rank(group)
    return received.get(me - 1), received.get(me + 1)


def _exchange(
    sends: Mapping[int, torch.Tensor],
    recv_shapes: Mapping[int, Sequence[int]],
    group: ProcessGroup | None,
    like: torch.Tensor,
) -> dict[int, torch.Tensor]:
    if not sends and not recv_shapes and not is_tracing():  # traced, every rank joins the one all-to-all
        return {}
    dtype, device = like.dtype, like.device
    return collectives.exchange_with_neighbours(dict(sends), dict(recv_shapes), group, dtype=dtype, device=device, anchor=like)


def _segment_rows(piece: torch.Tensor, dim: int, segment: Segment) -> torch.Tensor:
    if segment.step == 1:
        return piece.narrow(dim, segment.start, segment.length)
    if segment.step == -1:
        return piece.narrow(dim, segment.last, segment.length).flip(dim)
    return piece.narrow(dim, segment.start, 1).expand(with_extent(piece.shape, dim, segment.length))


def _accumulate_segment(grad_piece: torch.Tensor, dim: int, segment: Segment, grad: torch.Tensor) -> None:
    if segment.step == 1:
        grad_piece.narrow(dim, segment.start, segment.length).add_(grad)
    elif segment.step == -1:
        grad_piece.narrow(dim, segment.last, segment.length).add_(grad.flip(dim))
    else:
        grad_piece.narrow(dim, segment.start, 1).add_(grad.sum(dim, keepdim=True))


def _own_segment_position(segments: Sequence[Segment], me: int, extent: int) -> int | None:
    """Window position of the segment that is this rank's whole slab in ascending order, if any."""
    position = 0
    for segment in segments:
        if segment.source == me and segment.start == 0 and segment.length == extent and (segment.step == 1 or extent == 1):
            return position
        position += segment.length
    return None


def _is_whole_slab(segments: Sequence[Segment], me: int, extent: int) -> bool:
    return len(segments) == 1 and _own_segment_position(segments, me, extent) == 0


class _GatherWindow(torch.autograd.Function):
    """Forward: assemble the window from the slab, peers' rows and the constant.  Backward: the reverse."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, plan: WindowPlan, dim: int, group: ProcessGroup | None, value: float
    ) -> torch.Tensor:
        ctx.plan, ctx.dim, ctx.group, ctx.local_shape = plan, dim, group, local.shape
        sends = {peer: _rows(local, dim, rows) for peer, rows in plan.sends}
        recv_shapes = {peer: with_extent(local.shape, dim, count) for peer, count in plan.receives}
        pieces = _exchange(sends, recv_shapes, group, local)
        pieces[plan.me] = local
        if any(s.source == CONSTANT for s in plan.segments):
            pieces[CONSTANT] = local.new_full(with_extent(local.shape, dim, 1), value)
        if not plan.segments:
            return local.new_empty(with_extent(local.shape, dim, 0))
        if _is_whole_slab(plan.segments, plan.me, local.shape[dim]):
            return torch.ops.aten.alias(local)  # the window is the slab: no copy (and every stride kept)
        rows = [_segment_rows(pieces[s.source], dim, s) for s in plan.segments]
        order = channels_last_order(local)
        if order is not None:  # the halo rows laid out as the slab: torch.cat then keeps its layout
            rows = [in_memory_order(r, order) for r in rows]
        return torch.cat(rows, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        if creating_graph() and grad.requires_grad:  # the adjoint as a function autograd can differentiate
            return _ScatterWindow.apply(grad, ctx.plan, ctx.dim, ctx.group, ctx.local_shape), None, None, None, None
        return _scatter_window(grad, ctx.plan, ctx.dim, ctx.group, ctx.local_shape), None, None, None, None


def _scatter_window(
    grad: torch.Tensor, plan: WindowPlan, dim: int, group: ProcessGroup | None, local_shape: torch.Size
) -> torch.Tensor:
    """The adjoint of the window gather: each window row's gradient goes home and is added to its row."""
    own = _own_segment_position(plan.segments, plan.me, local_shape[dim])
    if own is None:
        grad_local = grad.new_zeros(local_shape)
    else:  # the window holds the whole slab once, ascending: start from that part, not zeros + add
        grad_local = grad.narrow(dim, own, local_shape[dim])
        mine = sum(1 for segment in plan.segments if segment.source == plan.me)
        if plan.sends or mine > 1:  # rows will be added to it: a copy of our own
            grad_local = grad_local.clone(memory_format=torch.preserve_format)
    grad_pieces = {peer: grad.new_zeros(with_extent(grad.shape, dim, count)) for peer, count in plan.receives}
    grad_pieces[plan.me] = grad_local
    position = 0
    for segment in plan.segments:
        if segment.source != CONSTANT and not (own is not None and position == own and segment.source == plan.me):
            piece_grad = grad.narrow(dim, position, segment.length)
            _accumulate_segment(grad_pieces[segment.source], dim, segment, piece_grad)
        position += segment.length
    sends = {peer: grad_pieces[peer] for peer, _ in plan.receives}
    recv_shapes = {peer: with_extent(grad.shape, dim, len(rows)) for peer, rows in plan.sends}
    returned = _exchange(sends, recv_shapes, group, grad)
    for peer, rows in plan.sends:
        _add_rows(grad_local, dim, rows, returned[peer])
    return grad_local


class _ScatterWindow(torch.autograd.Function):
    """The window gather's backward as a function, for double backward: its own backward is the gather.

    The gather is affine in the slab (constant rows do not depend on it), so the adjoint's
    adjoint is the gather with constant rows of zero.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, grad: torch.Tensor, plan: WindowPlan, dim: int, group: ProcessGroup | None, local_shape: torch.Size
    ) -> torch.Tensor:
        ctx.plan, ctx.dim, ctx.group = plan, dim, group
        return _scatter_window(grad, plan, dim, group, local_shape)

    @staticmethod
    def backward(ctx, grad_grad: torch.Tensor):  # type: ignore[override]
        return _GatherWindow.apply(grad_grad, ctx.plan, ctx.dim, ctx.group, 0.0), None, None, None, None


def gather_window(
    local: torch.Tensor,
    dim: int,
    sizes: Sequence[int],
    windows: Sequence[Window],
    *,
    group: ProcessGroup | None = None,
    mode: str = "constant",
    value: float = 0.0,
) -> torch.Tensor:
    """Global rows ``windows[me]`` of dim ``dim``, split over ``group`` as ``sizes``.  Differentiable.

    ``windows[r]`` is rank ``r``'s range ``[lo, hi)``: every rank passes all of them, so each
    knows what its peers take from it.  ``group=None`` means a dim held whole (one rank): the
    edge mode is then applied locally, without communication.
    """
    me = collectives.group_rank(group) if group is not None else 0
    if local.shape[dim] != sizes[me]:
        raise ValueError(f"slab extent {local.shape[dim]} along dim {dim} disagrees with the split {tuple(sizes)}")
    plan = plan_window(tuple(int(s) for s in sizes), tuple((int(lo), int(hi)) for lo, hi in windows), me, mode)
    return _GatherWindow.apply(local, plan, dim, group, value)


def scatter_window(
    window: torch.Tensor, dim: int, sizes: Sequence[int], windows: Sequence[Window], *, group: ProcessGroup | None = None
) -> torch.Tensor:
    """The adjoint of :func:`gather_window`: this rank's values for global rows ``windows[me]`` of
    dim ``dim``, each sent to the rank that owns its row under ``sizes`` and added there; rows
    beyond ``[0, extent)`` are dropped.  Returns this rank's slab.  Differentiable (its backward
    is the gather), so ops that spread values over neighbouring rows (``F.fold``) use it forward."""
    me = collectives.group_rank(group) if group is not None else 0
    lo, hi = windows[me]
    if window.shape[dim] != hi - lo:
        raise ValueError(f"window extent {window.shape[dim]} along dim {dim} disagrees with its rows [{lo}, {hi})")
    plan = plan_window(tuple(int(s) for s in sizes), tuple((int(lo), int(hi)) for lo, hi in windows), me, "constant")
    return _ScatterWindow.apply(window, plan, dim, group, torch.Size(with_extent(window.shape, dim, sizes[me])))


def halo_exchange(
    local: torch.Tensor,
    spec: ShardTensorSpec,
    axis: int,
    left: int,
    right: int,
    *,
    mode: str = "constant",
    value: float = 0.0,
) -> torch.Tensor:
    """This rank's slab widened by ``left``/``right`` rows of the dim sharded over mesh ``axis``.

    Rows come from whichever ranks own them (past an adjacent shard if it is small or empty);
    rows beyond the global edges follow ``mode``.  Only the rows a peer needs are sent.
    """
    dim = spec.shard_dim(axis)
    if dim is None:
        raise ValueError(f"mesh axis {axis} does not shard {spec}; halo exchange needs a Shard placement")
    sizes = spec.axis_sizes[axis]
    windows = uniform_windows(sizes, left, right)
    return gather_window(local, dim, sizes, windows, group=spec.mesh.get_group(axis), mode=mode, value=value)


def halo_exchange_nd(
    local: torch.Tensor,
    spec: ShardTensorSpec,
    widths: Mapping[int, tuple[int, int]],
    *,
    mode: str = "constant",
    value: float = 0.0,
) -> torch.Tensor:
    """Widen several dims (``{tensor dim: (left, right)}``) one after the other.

    Sharded dims exchange in mesh-axis order, each carrying the halos already gathered, so a 2-D
    decomposition gets its corner rows; dims held whole get their edge rows locally.
    """
    axis_of = {spec.shard_dim(axis): axis for axis in spec.sharded_axes()}
    for dim in sorted(widths, key=lambda d: (d not in axis_of, axis_of.get(d, d))):
        left, right = widths[dim]
        if dim in axis_of:
            local = halo_exchange(local, spec, axis_of[dim], left, right, mode=mode, value=value)
        elif left or right:
            extent = local.shape[dim]
            local = gather_window(local, dim, (extent,), ((-left, extent + right),), mode=mode, value=value)
    return local
