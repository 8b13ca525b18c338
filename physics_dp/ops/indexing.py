"""Indexing along sharded dims that moves only what is needed.

- ``aten.slice`` (``x[..., a:b:s]``, ``narrow``): each rank keeps the intersection of its range
  with the slice; the result stays sharded with those (uneven, possibly empty) sizes and nothing
  is sent.  ``aten.slice_backward`` pads each rank's gradient locally, also without communication;
  it cannot see the input's split, so it picks the one nearest to balanced that keeps every
  gradient row in place (a balanced input gets its own split back).
- ``aten.select`` (``x[..., i]``) on a sharded dim: the owning rank broadcasts the row over the
  mesh axis; the result is ``Replicate`` on that axis, a view of the slab on the owner.  Its
  backward (``select_backward``) sees only that replicated gradient and the global size, so the
  select's autograd node tells it the input's split (hooks set by ``x[..., i]`` / ``select`` at
  the function level): the gradient is zeros in that split with the row written by its owner,
  nothing sent, instead of the input's global shape on every rank.
- ``aten.roll``: each rank receives by point-to-point only the rows of its output that another
  rank holds (the rows that cross rank boundaries), for any shift, negative or past a shard.
- ``index_select`` / ``gather`` (function level, with their own backward): rows or elements are
  fetched from their owners by all-to-all; nothing is gathered whole.
- ``x[mask]`` / ``masked_select`` with a boolean ShardTensor mask of ``x``'s shape: a 1-D result
  sharded by rank order, each rank holding what it selected (uneven sizes), in global order.
- ``x[..., [i, j]] = v`` (``index_put``) along a sharded dim: each rank writes the picked rows it
  owns; nothing is sent but the values when they are split.  ``index_fill`` likewise, nothing sent.
- ``x[mask] = v`` and ``masked_scatter`` with a boolean mask of ``x``'s shape (any layout, or plain):
  one value (a number, a one-element tensor) is a local fill, nothing sent; a 1-D vector of
  values (``x[mask] = y[mask]``; ``masked_scatter``'s source, of which the first ones are used)
  is read in global row-major order: after one exchange of per-row counts each rank fetches only
  the values it writes.  A sharded source of more than one dim raises (pass 1-D, or replicate it).

Function-level handlers use ``autograd.Function``s whose backward knows the input's exact split;
aten-level handlers run below autograd, whose backward ops reach dispatch again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..distributed.tracing import is_tracing
from ..shard_tensor import Placement, Replicate, Shard, ShardTensor, ShardTensorSpec, balanced_sizes
from ..shard_tensor.conversions import distribute_tensor, from_local_with_spec, redistribute_to_spec, to_local
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.fallback import propagate_and_run
from ..shard_tensor.redistribute import redistribute_local
from ._local import ShardedOpError
from .halo import with_extent
from .pointwise import block_of_replicated

aten = torch.ops.aten

__all__ = [
    "replicated_plain",
    "offsets",
    "owner_ranks",
    "axis_sharding",
    "axis_splitting",
    "slice_plan",
    "RowPiece",
    "move_rows",
    "pieces_from",
    "sharded_slice",
]


# ----- split bookkeeping ---------------------------------------------------------------------------
def offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each rank's range (exclusive prefix sums)."""
    out, running = [], 0
    for size in sizes:
        out.append(running)
        running += size
    return out


def owner_ranks(index: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The rank holding each global row in ``index`` (empty ranks hold nothing)."""
    ends = torch.tensor([o + s for o, s in zip(offsets(sizes), sizes)], device=index.device)
    return torch.searchsorted(ends, index, right=True)


def axis_sharding(spec: ShardTensorSpec, dim: int) -> int | None:
    """The mesh axis that shards tensor dim ``dim``, if any."""
    for axis, placement in enumerate(spec.placements):
        if type(placement) is Shard and placement.dim == dim:
            return axis
    return None


def axis_splitting(spec: ShardTensorSpec, dim: int) -> int | None:
    """The mesh axis that splits ``dim`` over more than one rank, if any (a size-1 axis holds it whole)."""
    axis = axis_sharding(spec, dim)
    return axis if axis is not None and spec.mesh.size(axis) > 1 else None


def _meta_stride(spec: ShardTensorSpec, view: Any) -> tuple[int, ...]:
    """The global stride of a view, as a plain tensor of the spec's layout would have it."""
    return view(torch.empty_strided(spec.shape, spec.stride, device="meta")).stride()


def _with_dim_sizes(spec: ShardTensorSpec, axis: int, sizes: Sequence[int]) -> list:
    axis_sizes = list(spec.axis_sizes)
    axis_sizes[axis] = tuple(sizes)
    return axis_sizes


# ----- slicing ---------------------------------------------------------------------------------------
def _normalize_slice(start: int | None, end: int | None, extent: int) -> tuple[int, int]:
    start = 0 if start is None else start
    end = extent if end is None else end
    start = start + extent if start < 0 else start
    end = end + extent if end < 0 else end
    start = min(max(start, 0), extent)
    return start, min(max(end, start), extent)


def slice_plan(sizes: Sequence[int], start: int, end: int, step: int) -> list[tuple[int, int]]:
    """Per rank: (first selected row in its slab, number of selected rows) of ``start:end:step``."""
    plan = []
    for origin, size in zip(offsets(sizes), sizes):
        first = max(start, origin)
        first = start + -(-(first - start) // step) * step
        stop = min(end, origin + size)
        count = max(0, -(-(stop - first) // step))
        plan.append((first - origin if count else 0, count))
    return plan


def sharded_slice(tensor: ShardTensor, dim: int, start: int | None, end: int | None, step: int) -> ShardTensor:
    """``tensor[..., start:end:step, ...]`` along ``dim`` with no communication (below autograd)."""
    spec = tensor._spec
    extent = spec.shape[dim]
    start, end = _normalize_slice(start, end, extent)
    count = len(range(start, end, step))
    shape = list(spec.shape)
    shape[dim] = count
    axis_sizes = list(spec.axis_sizes)
    axis = axis_sharding(spec, dim)
    if axis is None:
        local = aten.slice.Tensor(tensor._local_tensor, dim, start, end, step)
    else:
        plan = slice_plan(spec.axis_sizes[axis], start, end, step)
        first, mine = plan[spec.coordinate()[axis]]
        local = aten.slice.Tensor(tensor._local_tensor, dim, first, _stop(first, mine, step), step)
        axis_sizes[axis] = tuple(c for _, c in plan)
    stride = _meta_stride(spec, lambda t: aten.slice.Tensor(t, dim, start, end, step))
    return ShardTensor(local, ShardTensorSpec(spec.mesh, spec.placements, shape, axis_sizes, stride))


def _stop(first: int, count: int, step: int) -> int:
    """An exclusive end that selects exactly ``count`` rows from ``first`` (0 when there are none)."""
    return first + (count - 1) * step + 1 if count else first


def _slice_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    tensor, dim, start, end, step = (*args, *[None] * (5 - len(args)))
    dim = kwargs.get("dim", 0 if dim is None else dim) % tensor._spec.ndim
    start = kwargs.get("start", start)
    end = kwargs.get("end", end)
    step = kwargs.get("step", 1 if step is None else step)
    return sharded_slice(tensor, dim, start, end, step)


def _grad_split(counts: Sequence[int], extent: int, start: int, step: int) -> list[int]:
    """A split of the sliced dim under which every rank's gradient rows are its own.

    The input's split is unknown to ``slice_backward``; each boundary may lie anywhere between
    the last selected row of the ranks before it and the first selected row of the ranks after
    it.  Clamping the balanced boundary into that window reproduces a balanced input exactly.
    """
    parts = len(counts)
    balanced = offsets(balanced_sizes(extent, parts))
    cumulative = offsets(counts)
    total = sum(counts)
    bounds = [0]
    for r in range(1, parts):
        k = cumulative[r]
        low = start + (k - 1) * step + 1 if k > 0 else 0
        high = start + k * step if k < total else extent
        bounds.append(min(max(balanced[r], low, bounds[-1]), high))
    bounds.append(extent)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _slice_backward_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    grad, input_sizes, dim, start, end, step = args
    dim %= len(input_sizes)
    spec = grad._spec
    axis = axis_sharding(spec, dim)
    if axis is None:
        return propagate_and_run(op, args, kwargs)
    start, end = _normalize_slice(start, end, input_sizes[dim])
    sizes = _grad_split(spec.axis_sizes[axis], input_sizes[dim], start, step)
    me = spec.coordinate()[axis]
    origin = offsets(sizes)[me]
    local_sizes = list(grad._local_tensor.shape)
    local_sizes[dim] = sizes[me]
    count = spec.axis_sizes[axis][me]
    first = start + offsets(spec.axis_sizes[axis])[me] * step - origin if count else 0
    local = aten.slice_backward.default(grad._local_tensor, local_sizes, dim, first, _stop(first, count, step), step)
    out = ShardTensorSpec(spec.mesh, spec.placements, input_sizes, _with_dim_sizes(spec, axis, sizes))
    return ShardTensor(local, out)


# ----- select ------------------------------------------------------------------------------------------
def _drop_dim(placements: Sequence[Placement], dim: int, axis: int) -> list[Placement]:
    """Placements after removing ``dim``: ``axis`` (which sharded it) becomes Replicate."""
    out: list[Placement] = []
    for a, placement in enumerate(placements):
        if a == axis:
            out.append(Replicate())
        elif type(placement) is Shard and placement.dim > dim:
            out.append(Shard(placement.dim - 1))
        else:
            out.append(placement)
    return out


def _select_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    tensor, dim, index = args
    spec = tensor._spec
    dim %= tensor.ndim
    axis = axis_sharding(spec, dim)
    if axis is None:
        return propagate_and_run(op, args, kwargs)
    extent = spec.shape[dim]
    if not -extent <= index < extent:
        raise IndexError(f"select(): index {index} out of range for dim {dim} of size {extent}")
    index %= extent
    sizes = spec.axis_sizes[axis]
    # the owner from the split alone (no tensor: a compiled graph would read it back as data)
    owner = next(r for r, (first, n) in enumerate(zip(offsets(sizes), sizes)) if first <= index < first + n)
    local_shape = list(spec.local_shape())
    del local_shape[dim]
    group = spec.mesh.get_group(axis)
    if spec.coordinate()[axis] == owner:
        # The owner returns a view, so ``x[..., i] = v`` (select + copy_) writes into its slab.
        row = tensor._local_tensor.select(dim, index - offsets(sizes)[owner])
        collectives.broadcast(row.contiguous(), owner, group)
    else:
        row = collectives.broadcast(tensor._local_tensor.new_empty(local_shape), owner, group)
    shape = [s for d, s in enumerate(spec.shape) if d != dim]
    axis_sizes = list(spec.axis_sizes)
    axis_sizes[axis] = None
    stride = _meta_stride(spec, lambda t: t.select(dim, index))
    placements = _drop_dim(spec.placements, dim, axis)
    return ShardTensor(row, ShardTensorSpec(spec.mesh, placements, shape, axis_sizes, stride))


class _SelectSource(threading.local):
    """The layout of the input whose select's backward runs next on this thread (set by the
    select node's pre-hook, taken by the ``select_backward`` it runs)."""

    spec: ShardTensorSpec | None = None


_select_source = _SelectSource()


def _announce_select_source(row: torch.Tensor, source: ShardTensorSpec) -> None:
    """Hooks on ``row``'s select node, so that its ``select_backward`` knows the input's split.

    That op sees only the gradient (replicated over the axis that split the selected dim) and the
    global size: on its own it builds the input's global shape, replicated, on every rank.  The
    row stays torch's own view, so in-place writes through it reach the slab and autograd sees
    them as for any view.
    """
    def announce(grad_outputs: Any) -> None:
        _select_source.spec = source

    def withdraw(grad_inputs: Any, grad_outputs: Any) -> None:
        _select_source.spec = None

    row.grad_fn.register_prehook(announce)
    row.grad_fn.register_hook(withdraw)


def _select_backward_in_source_split(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """A select's gradient in its input's split, when the select's node announced that split: zeros
    with the row written by its owner, nothing sent.  Other calls take the usual path (which keeps
    the gradient's own split, replicated over the selected dim)."""
    grad, input_sizes, dim, index = args
    source, _select_source.spec = _select_source.spec, None
    if source is None or not isinstance(grad, ShardTensor) or kwargs or tuple(source.shape) != tuple(input_sizes):
        return NotImplemented
    dim %= len(input_sizes)
    axis = axis_sharding(source, dim)
    if axis is None or not _is_select_layout(grad._spec, source, dim, axis):
        return NotImplemented
    return _row_in_split(grad._local_tensor, source, dim, index % input_sizes[dim], axis)


def _is_select_layout(spec: ShardTensorSpec, source: ShardTensorSpec, dim: int, axis: int) -> bool:
    """Whether ``spec`` is laid out as ``select(dim, i)`` of ``source``, whose ``dim`` ``axis`` splits."""
    axis_sizes = list(source.axis_sizes)
    axis_sizes[axis] = None
    return spec.placements == tuple(_drop_dim(source.placements, dim, axis)) and list(spec.axis_sizes) == axis_sizes


def _row_in_split(row: torch.Tensor, source: ShardTensorSpec, dim: int, index: int, axis: int) -> ShardTensor:
    local = row.new_zeros(source.local_shape())
    sizes = source.axis_sizes[axis]
    first = offsets(sizes)[source.coordinate()[axis]]
    if first <= index < first + local.shape[dim]:
        local.select(dim, index - first).copy_(row)
    return ShardTensor(local, source)


def sharded_select(tensor: ShardTensor, dim: int, index: int) -> torch.Tensor:
    """``tensor.select(dim, index)``, whose gradient comes back in ``tensor``'s own split."""
    row = run_default(torch.Tensor.select, (tensor, dim, index), {})
    spec = tensor._spec
    if row.grad_fn is not None and axis_splitting(spec, dim % tensor.ndim) is not None and not spec.has_partial and not is_tracing():
        _announce_select_source(row, spec.replace())
    return row


def _select_function_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    tensor = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    index = args[2] if len(args) > 2 else kwargs.get("index")
    if not isinstance(tensor, ShardTensor) or type(dim) is not int or type(index) is not int:
        return run_default(func, args, kwargs)
    return sharded_select(tensor, dim, index)


# ----- index_put: writing rows picked by a list along a sharded dim ------------------------------------
def _picked_dim(tensor: ShardTensor, indices: Sequence[Any]) -> tuple[int, torch.Tensor] | None:
    """(dim, index) when ``indices`` (``index_put``'s) picks rows of one dim sharded over more than
    one rank with a 1-D integer index every rank holds, every other dim whole (``x[:, :, [0, 6]]``)."""
    picked = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(picked) != 1:
        return None
    dim, index = picked[0]
    plain = replicated_plain(index)
    if axis_splitting(tensor._spec, dim) is None or plain is None or plain.ndim != 1:
        return None
    return (dim, plain) if plain.dtype in (torch.int64, torch.int32) else None


def _whole(values: torch.Tensor) -> torch.Tensor:
    """``values`` whole on this rank: the picked rows are few, so split values are gathered."""
    if not isinstance(values, ShardTensor):
        return values
    spec = values._spec
    replicated = ShardTensorSpec(spec.mesh, [Replicate()] * spec.mesh.ndim, spec.shape)
    return redistribute_local(values._local_tensor, spec, replicated)


def _owned_entries(
    spec: ShardTensorSpec, dim: int, axis: int, index: torch.Tensor, op_name: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Checks a global row ``index`` along ``dim`` (split over mesh ``axis``) as torch would, and
    returns it wrapped to ``[0, extent)``, the positions of the entries this rank owns, and the
    global index of this rank's first row."""
    extent = spec.shape[dim]
    if index.numel() and not (-extent <= int(index.min()) and int(index.max()) < extent):
        raise IndexError(f"{op_name}: index out of range for dim {dim} of size {extent}")
    index = index.long() % extent
    first, count = offsets(spec.axis_sizes[axis])[spec.coordinate()[axis]], spec.local_shape()[dim]
    return index, ((index >= first) & (index < first + count)).nonzero().squeeze(1), first


def _index_put_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``x[..., [i, j]] = v`` (``index_put``, in place or not) along a sharded dim: each rank writes
    the picked rows it owns, from the values' matching rows; nothing is sent (values split over
    ranks, a few rows, are gathered first).  DTensor has no rule that writes into a sharded dim
    (it raised), so boundary rows set by a list (``u[:, :, [0, -1]] = 0``) could not be written."""
    x, indices, values = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    found = _picked_dim(x, indices) if isinstance(x, ShardTensor) and not x._spec.has_partial else None
    if found is None or not isinstance(values, torch.Tensor) or is_tracing():  # (the routing reads the index's values)
        return propagate_and_run(op, args, kwargs)
    whole_values = _whole(values)
    dim, index = found
    spec = x._spec
    axis = axis_sharding(spec, dim)
    index, positions, first = _owned_entries(spec, dim, axis, index, "index_put")
    picked = with_extent(spec.shape, dim, index.numel())
    picked_spec = ShardTensorSpec(spec.mesh, spec.placements, picked, _with_dim_sizes(spec, axis, balanced_sizes(index.numel(), spec.mesh.size(axis))))
    others = [a for a in range(spec.mesh.ndim) if a != axis]
    rows = block_of_replicated(whole_values, picked_spec, others)
    rows = rows.broadcast_to(with_extent(spec.local_shape(), dim, index.numel())).index_select(dim, positions)
    local_indices = [None] * dim + [index.index_select(0, positions) - first]
    if op is aten.index_put_.default:
        op(x._local_tensor, local_indices, rows.to(x.dtype), accumulate)
        return x
    return ShardTensor(op(x._local_tensor, local_indices, rows.to(x.dtype), accumulate), spec.replace())


def _index_fill_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``x.index_fill(dim, index, value)`` (in place or not): each rank fills the listed rows it
    owns, nothing sent (DTensor has no rule that writes into a sharded dim, and refuses an in-place
    fill of a dim held by a one-rank axis)."""
    x, dim, index, value = args
    dim %= max(x.ndim, 1)
    plain = replicated_plain(index)
    if not isinstance(x, ShardTensor) or x._spec.has_partial or plain is None or isinstance(value, ShardTensor) or is_tracing():
        return propagate_and_run(op, args, kwargs)  # (the routing reads the index)
    spec = x._spec
    axis = axis_sharding(spec, dim)
    if axis is None:
        local_index = plain
    else:
        index, positions, first = _owned_entries(spec, dim, axis, plain.reshape(-1), "index_fill")
        local_index = index.index_select(0, positions) - first
    if op._schema.name.endswith("_"):
        op(x._local_tensor, dim, local_index, value)
        return x
    return ShardTensor(op(x._local_tensor, dim, local_index, value), spec.replace())


# ----- moving rows between ranks (roll, cat) --------------------------------------------------------------
@dataclass(frozen=True)
class RowPiece:
    """Rows ``[start, start + length)`` of part ``part``'s slab on rank ``src``, bound for rank ``dst``.

    A destination's pieces, in list order, make up its output; replicated parts are taken locally
    (``src == dst``).
    """

    part: int
    src: int
    start: int
    length: int
    dst: int


def move_rows(
    parts: Sequence[torch.Tensor], pieces: Sequence[RowPiece], dim: int, me: int, group: ProcessGroup
) -> torch.Tensor:
    """Assemble this rank's output from ``pieces`` with one point-to-point exchange.

    Only rows that change rank travel; every rank derives the whole plan from the splits alone.
    """
    ref = parts[0]
    sends: dict[int, list[torch.Tensor]] = {}
    recv_rows: dict[int, int] = {}
    for piece in pieces:
        if piece.src == piece.dst or not piece.length:
            continue
        if piece.src == me:
            sends.setdefault(piece.dst, []).append(parts[piece.part].narrow(dim, piece.start, piece.length))
        elif piece.dst == me:
            recv_rows[piece.src] = recv_rows.get(piece.src, 0) + piece.length
    received: dict[int, torch.Tensor] = {}
    if sends or recv_rows or is_tracing():  # traced, every rank joins the one all-to-all
        shape = list(ref.shape)
        recv_shapes = {peer: [*shape[:dim], rows, *shape[dim + 1 :]] for peer, rows in recv_rows.items()}
        received = collectives.exchange_with_neighbours(
            {peer: torch.cat(chunks, dim) for peer, chunks in sends.items()},
            recv_shapes,
            group,
            dtype=ref.dtype,
            device=ref.device,
            anchor=ref,
        )
    taken = {peer: 0 for peer in received}
    chunks = []
    for piece in pieces:
        if piece.dst != me or not piece.length:
            continue
        if piece.src == me:
            chunks.append(parts[piece.part].narrow(dim, piece.start, piece.length))
        else:
            chunks.append(received[piece.src].narrow(dim, taken[piece.src], piece.length))
            taken[piece.src] += piece.length
    if not chunks:
        shape = list(ref.shape)
        shape[dim] = 0
        return ref.new_empty(shape)
    return torch.cat(chunks, dim)


def pieces_from(sizes: Sequence[int], lo: int, hi: int, dst: int, part: int = 0) -> list[RowPiece]:
    """Pieces covering global rows ``[lo, hi)`` of a part split by ``sizes``."""
    pieces = []
    for src, (origin, size) in enumerate(zip(offsets(sizes), sizes)):
        start, stop = max(lo, origin), min(hi, origin + size)
        if stop > start:
            pieces.append(RowPiece(part, src, start - origin, stop - start, dst))
    return pieces


# ----- roll ---------------------------------------------------------------------------------------------------
def roll_pieces(sizes: Sequence[int], shift: int) -> list[RowPiece]:
    """Every rank's output of ``roll(shift)``: row ``i`` takes input row ``(i - shift) mod n``."""
    extent = sum(sizes)
    pieces = []
    for dst, (origin, size) in enumerate(zip(offsets(sizes), sizes)):
        first = (origin - shift) % extent if extent else 0
        head = min(size, extent - first)
        pieces += pieces_from(sizes, first, first + head, dst)
        pieces += pieces_from(sizes, 0, size - head, dst)
    return pieces


def _roll_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    tensor, shifts = args[0], list(args[1])
    dims = list(args[2]) if len(args) > 2 else list(kwargs.get("dims", []))
    spec = tensor._spec
    if not dims:
        if not spec.sharded_axes():
            return propagate_and_run(op, args, kwargs)
        raise ShardedOpError("roll", [tensor], "rolling the flattened tensor (no dims) is not supported; give dims")
    dims = [d % tensor.ndim for d in dims]
    local = tensor._local_tensor
    whole = [(s, d) for s, d in zip(shifts, dims) if axis_sharding(spec, d) is None]
    if whole:
        local = aten.roll.default(local, [s for s, _ in whole], [d for _, d in whole])
    for shift, dim in zip(shifts, dims):
        axis = axis_sharding(spec, dim)
        if axis is None or not spec.shape[dim]:
            continue
        pieces = roll_pieces(spec.axis_sizes[axis], shift % spec.shape[dim])
        local = move_rows([local], pieces, dim, spec.coordinate()[axis], spec.mesh.get_group(axis))
    return ShardTensor(local.contiguous(), spec.replace())


# ----- index_select -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _RowRequests:
    """What one rank sends and receives for ``index_select`` along a sharded dim.

    ``send_rows[p]``: rows of my slab that rank ``p`` needs (each once); ``recv_counts[p]``: how
    many rows I get from ``p``; ``inverse``: output row -> row of the received rows, concatenated
    in rank order (owners are monotone in the index, so that order is the sorted unique index).
    """

    send_rows: tuple[torch.Tensor, ...]
    recv_counts: tuple[int, ...]
    inverse: torch.Tensor

    def to(self, device: torch.device) -> _RowRequests:
        """The plan on ``device``; a host-to-GPU copy that does not block makes the GPU's stream no wait."""
        send_rows = tuple(rows.to(device, non_blocking=True) for rows in self.send_rows)
        return _RowRequests(send_rows, self.recv_counts, self.inverse.to(device, non_blocking=True))


def _row_requests(index: torch.Tensor, in_sizes: Sequence[int], out_sizes: Sequence[int], me: int) -> _RowRequests:
    parts = len(in_sizes)
    send_rows = []
    inverse = torch.empty(0, dtype=torch.long)
    recv_counts: tuple[int, ...] = ()
    for rank, (origin, size) in enumerate(zip(offsets(out_sizes), out_sizes)):
        unique, inv = torch.unique(index[origin : origin + size], sorted=True, return_inverse=True)
        owners = owner_ranks(unique, in_sizes)
        send_rows.append(unique[owners == me] - offsets(in_sizes)[me])
        if rank == me:
            inverse = inv
            recv_counts = tuple(torch.bincount(owners, minlength=parts).tolist())
    return _RowRequests(tuple(send_rows), recv_counts, inverse)


class _IndexSelectExchange(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, dim: int, plan: _RowRequests, group: ProcessGroup
    ) -> torch.Tensor:
        ctx.dim, ctx.plan, ctx.group, ctx.shape = dim, plan, group, local.shape
        sends = [local.index_select(dim, rows) for rows in plan.send_rows]
        shapes = [with_extent(local.shape, dim, n) for n in plan.recv_counts]
        received = collectives.all_to_all_chunks(sends, shapes, group)
        return torch.cat(received, dim).index_select(dim, plan.inverse)

    @staticmethod
    @once_differentiable  # the exchange back is not differentiated: refuse a double backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        dim, plan = ctx.dim, ctx.plan
        unique_rows = sum(plan.recv_counts)
        summed = grad.new_zeros(with_extent(grad.shape, dim, unique_rows)).index_add_(dim, plan.inverse, grad)
        sends = list(summed.split(list(plan.recv_counts), dim))
        shapes = [with_extent(ctx.shape, dim, len(rows)) for rows in plan.send_rows]
        received = collectives.all_to_all_chunks(sends, shapes, ctx.group)
        local_grad = grad.new_zeros(ctx.shape)
        local_grad.index_add_(dim, torch.cat(plan.send_rows), torch.cat(received, dim))
        return local_grad, None, None, None


def replicated_plain(value: Any) -> torch.Tensor | None:
    """A plain tensor, or the slab of a fully replicated ShardTensor; None for anything else."""
    if isinstance(value, ShardTensor):
        return value._local_tensor if all(type(p) is Replicate for p in value.placements) else None
    return value if isinstance(value, torch.Tensor) else None


def sharded_index_select(tensor: ShardTensor, dim: int, index: torch.Tensor) -> ShardTensor:
    """``index_select``: each rank fetches the distinct rows it needs from their owners (local if ``dim`` is whole).

    The result is split evenly along ``dim``; every rank knows the whole (replicated) index, so
    each derives what it sends without asking.
    """
    spec = tensor._spec
    axis = axis_sharding(spec, dim)
    index = index.reshape(-1).long()
    host_index = index.cpu()  # the checks and the routing read its values: on a GPU one wait, not one per read
    extent = spec.shape[dim]
    if host_index.numel() and (int(host_index.min()) < 0 or int(host_index.max()) >= extent):
        raise IndexError(f"index_select(): index out of range for dim {dim} of size {extent}")
    shape = with_extent(spec.shape, dim, index.numel())
    if axis is None:
        local = to_local(tensor).index_select(dim, index)
        return from_local_with_spec(local, ShardTensorSpec(spec.mesh, spec.placements, shape, spec.axis_sizes))
    parts = spec.mesh.size(axis)
    out_sizes = balanced_sizes(index.numel(), parts)
    me = spec.coordinate()[axis]
    plan = _row_requests(host_index, spec.axis_sizes[axis], out_sizes, me).to(index.device)
    local = _IndexSelectExchange.apply(to_local(tensor), dim, plan, spec.mesh.get_group(axis))
    out = ShardTensorSpec(spec.mesh, spec.placements, shape, _with_dim_sizes(spec, axis, out_sizes))
    return from_local_with_spec(local, out)


def _index_select_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    index = args[2] if len(args) > 2 else kwargs.get("index")
    plain = replicated_plain(index)
    usable = isinstance(tensor, ShardTensor) and isinstance(dim, int) and "out" not in kwargs
    if not usable or plain is None or plain.ndim > 1:
        return run_default(func, args, kwargs)
    return sharded_index_select(tensor, dim % tensor.ndim, plain)


# ----- gather -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _ElementRequests:
    """Element exchange for ``gather``: my requests sorted by owner, and what peers asked of me."""

    order: torch.Tensor  # my output elements (flat) sorted by owning rank
    send_counts: tuple[int, ...]  # my requests per owner
    served: torch.Tensor  # flat positions in my slab that peers asked for, in rank order
    served_counts: tuple[int, ...]


def _flat_positions(
    local: torch.Tensor, index: torch.Tensor, owners: torch.Tensor, dim: int, sizes: Sequence[int]
) -> torch.Tensor:
    """For each index element, its flat position in the owner's slab (slabs differ only along ``dim``)."""
    device = index.device
    rows = index - torch.tensor(offsets(sizes), device=device)[owners]
    outer = torch.zeros((), dtype=torch.long, device=device)
    tail = torch.zeros((), dtype=torch.long, device=device)
    for d, n in enumerate(index.shape):
        coordinate = torch.arange(n, device=device).view([-1 if e == d else 1 for e in range(index.ndim)])
        if d < dim:
            outer = outer * local.shape[d] + coordinate
        elif d > dim:
            tail = tail * local.shape[d] + coordinate
    inner = int(torch.Size(local.shape[dim + 1 :]).numel())
    return ((outer * torch.tensor(list(sizes), device=device)[owners] + rows) * inner + tail).reshape(-1)


def _element_requests(
    local: torch.Tensor, index: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup
) -> _ElementRequests:
    """Ask every owner for the flat positions of the elements this rank's output block needs."""
    parts = len(sizes)
    owners = owner_ranks(index, sizes)
    order = torch.argsort(owners.reshape(-1), stable=True)
    send_counts = torch.bincount(owners.reshape(-1), minlength=parts)
    counts = collectives.all_to_all_chunks(list(send_counts.view(parts, 1)), [[1]] * parts, group)
    served_counts = tuple(int(c) for c in torch.cat(counts))
    asked = _flat_positions(local, index, owners, dim, sizes)[order].split(send_counts.tolist())
    requests = collectives.all_to_all_chunks(list(asked), [[n] for n in served_counts], group)
    return _ElementRequests(order, tuple(send_counts.tolist()), torch.cat(requests), served_counts)


class _GatherExchange(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, plan: _ElementRequests, out_shape: Sequence[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.plan, ctx.group, ctx.shape = plan, group, local.shape
        values = local.reshape(-1)[plan.served]
        received = collectives.all_to_all_chunks(
            list(values.split(list(plan.served_counts))), [[n] for n in plan.send_counts], group
        )
        out = values.new_empty(int(torch.Size(out_shape).numel()))
        out[plan.order] = torch.cat(received)
        return out.view(tuple(out_shape))

    @staticmethod
    @once_differentiable  # the exchange back is not differentiated: refuse a double backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        plan = ctx.plan
        ordered = grad.reshape(-1)[plan.order]
        received = collectives.all_to_all_chunks(
            list(ordered.split(list(plan.send_counts))), [[n] for n in plan.served_counts], ctx.group
        )
        local_grad = grad.new_zeros(int(torch.Size(ctx.shape).numel()))
        local_grad.index_add_(0, plan.served, torch.cat(received))
        return local_grad.view(ctx.shape), None, None, None


def _gather_index_spec(tensor: ShardTensor, dim: int, index: torch.Tensor) -> ShardTensorSpec | None:
    """The output (= index) spec: ``tensor``'s placements; None where the index cannot follow them."""
    spec = tensor._spec
    if index.ndim != tensor.ndim or spec.has_partial:
        return None
    axis_sizes: list = []
    for axis, placement in enumerate(spec.placements):
        if type(placement) is not Shard:
            axis_sizes.append(None)
        elif placement.dim == dim:
            current = index._spec if isinstance(index, ShardTensor) else None
            if current is not None and current.placements[axis] == placement:
                axis_sizes.append(current.axis_sizes[axis])
            else:
                axis_sizes.append(balanced_sizes(index.shape[dim], spec.mesh.size(axis)))
        elif index.shape[placement.dim] == spec.shape[placement.dim]:
            axis_sizes.append(spec.axis_sizes[axis])
        else:
            return None
    return ShardTensorSpec(spec.mesh, spec.placements, index.shape, axis_sizes)


def sharded_gather(tensor: ShardTensor, dim: int, index: torch.Tensor) -> ShardTensor | None:
    """``gather``: along a sharded dim each element is fetched from its owner (requests, then values).

    None where the index cannot follow ``tensor``'s split (the fallback then runs it).
    """
    spec = tensor._spec
    out_spec = _gather_index_spec(tensor, dim, index)
    if out_spec is None:
        return None
    if isinstance(index, ShardTensor):
        local_index = redistribute_to_spec(index.detach(), out_spec)._local_tensor
    else:
        local_index = distribute_tensor(index, spec.mesh, out_spec.placements, _split(out_spec))._local_tensor
    axis = axis_sharding(spec, dim)
    extent = spec.shape[dim]
    if local_index.numel() and (int(local_index.min()) < 0 or int(local_index.max()) >= extent):
        raise IndexError(f"gather(): index out of range for dim {dim} of size {extent}")
    local = to_local(tensor)
    if axis is None:
        return from_local_with_spec(local.gather(dim, local_index), out_spec)
    group = spec.mesh.get_group(axis)
    plan = _element_requests(local, local_index.long(), dim, spec.axis_sizes[axis], group)
    result = _GatherExchange.apply(local, plan, local_index.shape, group)
    return from_local_with_spec(result, out_spec)


def _split(spec: ShardTensorSpec) -> dict[int, Sequence[int]]:
    return {axis: sizes for axis, sizes in enumerate(spec.axis_sizes) if sizes is not None}


def _gather_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    index = args[2] if len(args) > 2 else kwargs.get("index")
    usable = (
        isinstance(tensor, ShardTensor)
        and isinstance(index, torch.Tensor)
        and isinstance(dim, int)
        and "out" not in kwargs
        and not kwargs.get("sparse_grad", False)
    )
    if usable:
        result = sharded_gather(tensor, dim % tensor.ndim, index)
        if result is not None:
            return result
    return run_default(func, args, kwargs)


# ----- boolean masks ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _MaskPlan:
    """Where this rank's selected values go and where the values it receives belong.

    Output positions follow the global row-major order; ``send_bounds[q]`` is the run of my
    selected values (in local order) that rank ``q`` holds in the output, ``recv_positions[q]``
    the places in my output block of the values ``q`` sends me.
    """

    send_bounds: tuple[tuple[int, int], ...]
    recv_positions: tuple[torch.Tensor, ...]
    count: int


def _runs(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(start, start + length)`` for every run."""
    total = int(lengths.sum())
    shift = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
    return shift + torch.arange(total)


def _mask_plan(counts: torch.Tensor, me: int) -> _MaskPlan:
    """``counts[p, r]``: elements rank ``r`` selects in block ``p`` (the dims before the sharded one)."""
    flat = counts.reshape(-1)
    block_starts = (torch.cumsum(flat, 0) - flat).view(counts.shape)
    totals = counts.sum(0)
    out_starts = torch.cumsum(totals, 0) - totals
    lo, hi = int(out_starts[me]), int(out_starts[me] + totals[me])
    mine = _runs(block_starts[:, me], counts[:, me])
    edges = torch.searchsorted(mine, torch.cat([out_starts, totals.sum().view(1)])).tolist()
    send_bounds = tuple(zip(edges[:-1], edges[1:]))
    recv_positions = []
    for peer in range(counts.shape[1]):
        starts = block_starts[:, peer].clamp(lo, hi)
        stops = (block_starts[:, peer] + counts[:, peer]).clamp(lo, hi)
        recv_positions.append(_runs(starts, stops - starts) - lo)
    return _MaskPlan(send_bounds, tuple(recv_positions), hi - lo)


class _MaskedSelectExchange(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, mask: torch.Tensor, plan: _MaskPlan, group: ProcessGroup
    ) -> torch.Tensor:
        ctx.mask, ctx.plan, ctx.group = mask, plan, group
        values = local[mask]
        received = collectives.all_to_all_chunks(
            [values[a:b] for a, b in plan.send_bounds], [[len(p)] for p in plan.recv_positions], group
        )
        out = values.new_empty(plan.count)
        for positions, chunk in zip(plan.recv_positions, received):
            out[positions] = chunk
        return out

    @staticmethod
    @once_differentiable  # the exchange back is not differentiated: refuse a double backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        plan = ctx.plan
        received = collectives.all_to_all_chunks(
            [grad[positions] for positions in plan.recv_positions], [[b - a] for a, b in plan.send_bounds], ctx.group
        )
        local_grad = grad.new_zeros(ctx.mask.shape).masked_scatter(ctx.mask, torch.cat(received))
        return local_grad, None, None, None


def _mask_layout(spec: ShardTensorSpec) -> tuple[ShardTensorSpec, int | None]:
    """Keep the first sharded axis (the result's split), replicate the others; Partial stays pending."""
    axes = spec.sharded_axes()
    keep = axes[0] if axes else None
    placements = [Replicate() if type(p) is Shard and a != keep else p for a, p in enumerate(spec.placements)]
    sizes = [s if a == keep else None for a, s in enumerate(spec.axis_sizes)]
    return ShardTensorSpec(spec.mesh, placements, spec.shape, sizes), keep


def sharded_masked_select(tensor: ShardTensor, mask: torch.Tensor) -> ShardTensor:
    """``tensor[mask]``: a 1-D result sharded by rank order, in global row-major order.

    Each rank keeps as many values as it selected; values move only where the dims before the
    sharded one interleave ranks in the global order.  On a 2-D mesh the other sharded axes are
    replicated first (a 1-D result can be split over one mesh axis only).
    """
    spec, axis = _mask_layout(tensor._spec)
    tensor = redistribute_to_spec(tensor, spec)
    mask_placements = [Replicate() if p.is_partial() else p for p in spec.placements]
    mask_spec = ShardTensorSpec(spec.mesh, mask_placements, spec.shape, spec.axis_sizes)
    if isinstance(mask, ShardTensor):
        local_mask = redistribute_to_spec(mask.detach(), mask_spec)._local_tensor
    else:
        local_mask = distribute_tensor(mask, spec.mesh, mask_spec.placements, _split(mask_spec))._local_tensor
    local = to_local(tensor)
    if axis is None:
        values = local[local_mask]
        return from_local_with_spec(values, ShardTensorSpec(spec.mesh, spec.placements, values.shape))
    dim = spec.shard_dim(axis)
    group = spec.mesh.get_group(axis)
    blocks = int(torch.Size(spec.shape[:dim]).numel())
    mine = local_mask.reshape(blocks, -1).sum(1)
    gathered = collectives.gather_sizes(mine.tolist(), group)
    counts = torch.tensor(gathered, dtype=torch.long).view(spec.mesh.size(axis), blocks).T
    plan = _mask_plan(counts, spec.coordinate()[axis])
    values = _MaskedSelectExchange.apply(local, local_mask, plan, group)
    placements = [Shard(0) if a == axis else p for a, p in enumerate(spec.placements)]
    sizes = [tuple(counts.sum(0).tolist()) if a == axis else None for a in range(spec.mesh.ndim)]
    return from_local_with_spec(values, ShardTensorSpec(spec.mesh, placements, [int(counts.sum())], sizes))


def _is_mask_of(tensor: Any, mask: Any) -> bool:
    return (
        isinstance(tensor, ShardTensor)
        and isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.shape == tensor.shape
        and not (isinstance(mask, ShardTensor) and mask._spec.has_partial)
    )


def _is_index_list(entry: Any) -> bool:
    """A list of non-negative ints (``x[:, :, [1, 9]]``): an index_select (negative ones are left to torch)."""
    return isinstance(entry, list) and bool(entry) and all(type(i) is int and i >= 0 for i in entry)


def _entries_per_dim(key: Any, ndim: int) -> list[Any] | None:
    """The entries of an indexing ``key``, one per dim it addresses (``...`` expanded to full slices);
    None for a key with more than one ``...``."""
    entries = list(key) if isinstance(key, tuple) else [key]
    ellipses = [i for i, e in enumerate(entries) if e is Ellipsis]
    if len(ellipses) > 1:
        return None
    if ellipses:
        at = ellipses[0]
        entries = entries[:at] + [slice(None)] * (ndim - len(entries) + 1) + entries[at + 1 :]
    return entries


def _is_full_slice(entry: Any) -> bool:
    return isinstance(entry, slice) and entry == slice(None)


def _index_dim(key: Any, ndim: int) -> tuple[int, torch.Tensor] | None:
    """(dim, index) when ``key`` is full slices (and one ``...``) around one 1-D integer tensor or list."""
    entries = _entries_per_dim(key, ndim)
    if entries is None:
        return None
    entries = [torch.tensor(e) if _is_index_list(e) else e for e in entries]
    tensors = [(d, e) for d, e in enumerate(entries) if isinstance(e, torch.Tensor)]
    full = all(isinstance(e, torch.Tensor) or _is_full_slice(e) for e in entries)
    if len(entries) > ndim or len(tensors) != 1 or not full:
        return None
    dim, index = tensors[0]
    plain = replicated_plain(index)
    if plain is None or plain.ndim != 1 or plain.dtype not in (torch.int64, torch.int32):
        return None
    return dim, plain


def _int_entries(key: Any, ndim: int) -> list[tuple[int, int]] | None:
    """(dim, index) of each int when ``key`` is ints and full slices (and one ``...``), e.g. ``x[:, :, 15]``."""
    entries = _entries_per_dim(key, ndim)
    if entries is None or len(entries) > ndim or not all(type(e) is int or _is_full_slice(e) for e in entries):
        return None
    return [(d, e) for d, e in enumerate(entries) if type(e) is int]


def _getitem_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    tensor, key = args
    single = key[0] if isinstance(key, tuple) and len(key) == 1 else key
    if _is_mask_of(tensor, single):
        return sharded_masked_select(tensor, single)
    if not isinstance(tensor, ShardTensor):
        return run_default(func, args, kwargs)
    found = _index_dim(key, tensor.ndim)
    if found is not None:
        return sharded_index_select(tensor, *found)
    selects = _int_entries(key, tensor.ndim)
    if selects and any(axis_sharding(tensor._spec, d) is not None for d, _ in selects):
        for dim, index in reversed(selects):  # last dim first: the earlier dims keep their numbers
            tensor = sharded_select(tensor, dim, index)
        return tensor
    return run_default(func, args, kwargs)


def _masked_select_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    if "out" not in kwargs and _is_mask_of(tensor, mask):
        return sharded_masked_select(tensor, mask)
    return run_default(func, args, kwargs)


# ----- boolean-mask assignment --------------------------------------------------------------------------
def _mask_slab(tensor: ShardTensor, mask: torch.Tensor) -> torch.Tensor:
    """``mask``'s slab in ``tensor``'s layout: a plain mask is cut locally, a sharded one moved."""
    spec = tensor._spec
    mask_spec = ShardTensorSpec(spec.mesh, spec.placements, spec.shape, spec.axis_sizes)
    if isinstance(mask, ShardTensor):
        return redistribute_to_spec(mask.detach(), mask_spec)._local_tensor
    return distribute_tensor(mask, spec.mesh, spec.placements, _split(spec))._local_tensor


def _splitting_axes(spec: ShardTensorSpec) -> list[int]:
    return [a for a in spec.sharded_axes() if spec.mesh.size(a) > 1]


@dataclass(frozen=True)
class _Pieces:
    """Where every rank's True elements sit in the global row-major order.

    A piece is one row of a slab over the dims before the last split one: its True elements form
    one run of that order.  ``counts`` / ``starts`` (CPU) have the global shape of those dims plus
    one dim for the ranks along the last split axis (``last``; None for an unsplit tensor).
    """

    counts: torch.Tensor
    starts: torch.Tensor
    last: int | None

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def positions(self, spec: ShardTensorSpec, coordinate: Sequence[int]) -> torch.Tensor:
        """Global positions, in slab order, of the True elements of the rank at ``coordinate``."""
        index: list[Any] = [slice(None)] * (self.counts.ndim - 1) + [0 if self.last is None else coordinate[self.last]]
        for axis in _splitting_axes(spec):
            if axis != self.last:
                sizes = spec.axis_sizes[axis]
                first = offsets(sizes)[coordinate[axis]]
                index[spec.shard_dim(axis)] = slice(first, first + sizes[coordinate[axis]])
        return _runs(self.starts[tuple(index)].reshape(-1), self.counts[tuple(index)].reshape(-1))


def _pieces(local_mask: torch.Tensor, spec: ShardTensorSpec, op: str, tensor: ShardTensor) -> _Pieces:
    """Gather every rank's count per piece (one int per row of the leading dims), axis by axis."""
    axes = _splitting_axes(spec)
    if len({spec.shard_dim(a) for a in axes}) != len(axes):
        raise ShardedOpError(op, [tensor], "a dim split over two mesh axes is not supported; redistribute first")
    if not axes:
        counts, last = local_mask.sum().view(1).cpu(), None
    else:
        last = max(axes, key=spec.shard_dim)
        dim = spec.shard_dim(last)
        counts = local_mask.flatten(dim).sum(-1).unsqueeze(-1)
        counts = collectives.all_gather_along_dim(counts, [1] * spec.mesh.size(last), dim, spec.mesh.get_group(last))
        for axis in axes:
            if axis != last:
                group = spec.mesh.get_group(axis)
                counts = collectives.all_gather_along_dim(counts, spec.axis_sizes[axis], spec.shard_dim(axis), group)
        counts = counts.cpu()
    flat = counts.reshape(-1)
    return _Pieces(counts, (torch.cumsum(flat, 0) - flat).view(counts.shape), last)


@dataclass(frozen=True)
class _TakePlan:
    """Which values of a 1-D vector (in global order) this rank writes, and from whom.

    ``serve[q]``: positions in my block of the values rank ``q`` of ``group`` writes (the whole
    vector, no ``group``: a replicated vector is read locally); ``take[q]``: how many I get from
    ``q``; the values' gradient is summed over ``sum_groups`` (other ranks wrote other values).
    """

    serve: tuple[torch.Tensor, ...]
    take: tuple[int, ...]
    length: int
    group: ProcessGroup | None
    sum_groups: tuple[ProcessGroup, ...]


def _take_plan(pieces: _Pieces, spec: ShardTensorSpec, vector: ShardTensorSpec | None, length: int) -> _TakePlan:
    me = spec.coordinate()
    mine = pieces.positions(spec, me)
    splitting = _splitting_axes(spec)
    axis = None if vector is None else next(iter(_splitting_axes(vector)), None)
    sum_groups = tuple(spec.mesh.get_group(a) for a in splitting if a != axis)
    if axis is None:
        return _TakePlan((mine,), (len(mine),), length, None, sum_groups)
    sizes = vector.axis_sizes[axis]
    bounds = torch.tensor(offsets(sizes) + [sum(sizes)])
    lo, hi = int(bounds[me[axis]]), int(bounds[me[axis] + 1])
    serve = []
    for peer in range(len(sizes)):
        theirs = pieces.positions(spec, [peer if a == axis else c for a, c in enumerate(me)])
        serve.append(theirs[(theirs >= lo) & (theirs < hi)] - lo)
    take = torch.searchsorted(mine, bounds).diff().tolist()
    return _TakePlan(tuple(serve), tuple(take), hi - lo, spec.mesh.get_group(axis), sum_groups)


class _TakeValues(torch.autograd.Function):
    """The values this rank writes, in slab order; backward sends each gradient to the value's holder."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, plan: _TakePlan) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        chunks = [values[rows.to(values.device)] for rows in plan.serve]
        if plan.group is None:
            return chunks[0]
        return torch.cat(collectives.all_to_all_chunks(chunks, [[n] for n in plan.take], plan.group))

    @staticmethod
    @once_differentiable  # the exchange back is not differentiated: refuse a double backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        plan = ctx.plan
        back = [grad]
        if plan.group is not None:
            back = collectives.all_to_all_chunks(list(grad.split(list(plan.take))), [[len(r)] for r in plan.serve], plan.group)
        rows = torch.cat(plan.serve).to(grad.device)
        values_grad = grad.new_zeros(plan.length).index_put_((rows,), torch.cat(back))
        for group in plan.sum_groups:
            values_grad = collectives.all_reduce(values_grad, "sum", group)
        return values_grad, None


def _vector(values: torch.Tensor, mesh: Any) -> tuple[torch.Tensor, ShardTensorSpec | None]:
    """A 1-D vector's slab (autograd-linked) and its layout, split over one mesh axis at most."""
    if not isinstance(values, ShardTensor):
        return values, None
    spec = values._spec
    axes = _splitting_axes(spec)
    placements = [Shard(0) if axes and a == axes[0] else Replicate() for a in range(mesh.ndim)]
    sizes = [spec.axis_sizes[a] if axes and a == axes[0] else None for a in range(mesh.ndim)]
    values = redistribute_to_spec(values, ShardTensorSpec(mesh, placements, spec.shape, sizes))
    return to_local(values), (values._spec if axes else None)


def masked_write(tensor: ShardTensor, mask: torch.Tensor, values: Any, op: str, inplace: bool) -> ShardTensor:
    """``tensor`` with its True positions set: one value (python or numel 1) everywhere, nothing
    sent; else the values of a 1-D vector in global row-major order (``x[mask] = v`` needs all
    of them, ``masked_scatter`` its first ones), each rank fetching only those it writes.

    Every check depends on layouts and global counts only, so every rank raises alike.
    """
    spec = tensor._spec
    if spec.has_partial or any(type(p) not in (Shard, Replicate) for p in spec.placements):
        raise ShardedOpError(op, [tensor], "the destination must be sharded or replicated (redistribute it first)")
    if isinstance(values, ShardTensor) and values._spec.mesh is not spec.mesh:
        raise ShardedOpError(op, [tensor, values], "the values live on another mesh")
    local_mask = _mask_slab(tensor, mask)
    if op == "x[mask] = v" and (not isinstance(values, torch.Tensor) or values.numel() == 1):
        fill = values.reshape(()) if isinstance(values, torch.Tensor) else values
        sharded_mask = ShardTensor(local_mask, ShardTensorSpec(spec.mesh, spec.placements, spec.shape, spec.axis_sizes))
        return (tensor.masked_fill_ if inplace else tensor.masked_fill)(sharded_mask, fill)
    if is_tracing():
        raise ShardedOpError(op, [tensor], "the mask's values route the write; run it outside torch.compile")
    pieces = _pieces(local_mask, spec, op, tensor)
    if op == "x[mask] = v":
        while values.ndim > 1 and values.shape[0] == 1:
            values = values[0]
        if values.ndim != 1 or len(values) != pieces.total:
            raise IndexError(f"{op}: value of shape {list(values.shape)} cannot be broadcast to indexing result of shape [{pieces.total}]")
    else:
        if isinstance(values, ShardTensor) and values.ndim > 1 and _splitting_axes(values._spec):
            raise ShardedOpError(
                op, [tensor, values], "a sharded multi-dim source is not supported: pass a 1-D source (e.g. "
                "src[mask]), or src.full_tensor(); torch.where(mask, src, x) writes src position by position"
            )
        values = values.reshape(-1)
        if values.numel() < pieces.total:
            raise RuntimeError(f"{op}: number of elements of source < number of ones in mask")
    if values.dtype != tensor.dtype:
        raise RuntimeError(f"{op}: expected values of dtype {tensor.dtype}, got {values.dtype}")
    local_values, layout = _vector(values, spec.mesh)
    taken = _TakeValues.apply(local_values, _take_plan(pieces, spec, layout, local_values.numel()))
    result = from_local_with_spec(to_local(tensor).masked_scatter(local_mask, taken), spec.replace())
    return tensor.copy_(result) if inplace else result


def _setitem_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> None:
    """``x[mask] = v`` with a boolean mask of ``x``'s shape: torch's ``index_put_`` on the slab
    would read the whole mask against the slab; the write is done sharded and copied in place."""
    tensor, key, values = args
    mask = key[0] if isinstance(key, tuple) and len(key) == 1 else key
    if not _is_mask_of(tensor, mask) or tensor._spec.local_only:  # (local-only: torch's own write on the slab)
        return run_default(func, args, kwargs)
    masked_write(tensor, mask, values, "x[mask] = v", inplace=True)


def _masked_scatter_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """``masked_scatter`` (DTensor has no rule): the source's first values in row-major order go
    to the True positions, each rank fetching those it writes."""
    tensor = args[0]
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    source = args[2] if len(args) > 2 else kwargs.get("source")
    if not _is_mask_of(tensor, mask) or tensor._spec.local_only or not isinstance(source, torch.Tensor):
        return run_default(func, args, kwargs)
    return masked_write(tensor, mask, source, "masked_scatter", inplace=func is torch.Tensor.masked_scatter_)


# ----- registration -----------------------------------------------------------------------------------------
ShardTensor.register_dispatch_handler(aten.slice.Tensor, _slice_handler)
ShardTensor.register_dispatch_handler(aten.slice_backward.default, _slice_backward_handler)
ShardTensor.register_dispatch_handler(aten.select.int, _select_handler)
ShardTensor.register_dispatch_handler(aten.select_backward.default, _select_backward_in_source_split, first=True)
ShardTensor.register_dispatch_handler(aten.roll.default, _roll_handler)
for _op in (aten.index_fill_.int_Scalar, aten.index_fill_.int_Tensor, aten.index_fill.int_Scalar, aten.index_fill.int_Tensor):
    ShardTensor.register_dispatch_handler(_op, _index_fill_handler)
for _op in (aten.index_put_.default, aten.index_put.default):
    ShardTensor.register_dispatch_handler(_op, _index_put_handler)
for _func in (torch.index_select, torch.Tensor.index_select):
    ShardTensor.register_function_handler(_func, _index_select_handler)
for _func in (torch.gather, torch.Tensor.gather):
    ShardTensor.register_function_handler(_func, _gather_handler)
for _func in (torch.masked_select, torch.Tensor.masked_select):
    ShardTensor.register_function_handler(_func, _masked_select_handler)
ShardTensor.register_function_handler(torch.Tensor.__getitem__, _getitem_handler)
# in place: the handlers must see the tensor itself, in every layout (not a converted copy or its slab)
ShardTensor.register_function_handler(torch.Tensor.__setitem__, _setitem_handler, every_layout=True)
for _func in (torch.masked_scatter, torch.Tensor.masked_scatter, torch.Tensor.masked_scatter_):
    ShardTensor.register_function_handler(_func, _masked_scatter_handler, every_layout=True)
for _func in (torch.select, torch.Tensor.select):
    ShardTensor.register_function_handler(_func, _select_function_handler)
