"""Shape ops that the DTensor-rule fallback gets wrong or expensive on uneven shards.

- ``squeeze``: the fallback moves the tensor to the ``torch.chunk`` split; here sizes are kept
  (a squeezed dim that is sharded, global extent 1, is replicated on its axis first).
- ``split`` / ``chunk`` along a sharded dim: every piece is a slice, sharded with the
  intersection of each rank's range, and nothing is sent (the fallback gathers everything).
- ``unbind`` along a sharded dim: the axis moves to the largest free dim by one all-to-all
  (replicated only when no dim can take it), then every rank unbinds its slab.
- ``cat`` along a sharded dim: the output split keeps every sharded input's rows where they
  are whenever each rank's rows form one contiguous run of the output (``split``'s backward,
  inputs padded by replicated tensors); otherwise rows move by point-to-point to a balanced
  split.  Replicated inputs are sliced locally.

Backward ops reach dispatch again (``cat`` for split, ``stack`` for unbind, ``slice`` for cat), so
gradients are exact but come in the layout the forward output implies; the consumer
redistributes if needed.  Except for ``torch.cat`` along a sharded dim: there each input's
gradient is moved back into the input's own layout as it leaves the cat, a few rows for a
slice of the input (manual periodic padding, ``cat([x[-1:], x, x[:1]])``), where the slice's
gradient would otherwise reach the input's other uses zero-padded to a whole slab in the
output's split, and move whole.

- ``pixel_unshuffle`` with a split of H or W that cuts the factor x factor blocks: the slabs move
  to a balanced split of whole blocks first (torch's kernel checks the slab's extent).

``unsqueeze``, ``flatten``/``unflatten`` (``views.py``), ``permute``, ``transpose`` and ``stack``
keep their splits through the fallback and need no handler here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..shard_tensor import Placement, Replicate, Shard, ShardTensor, ShardTensorSpec, balanced_sizes
from ..shard_tensor.conversions import keep_grad_layout
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.fallback import propagate_and_run
from ..shard_tensor.redistribute import redistribute_local
from ..shard_tensor.spec import contiguous_strides
from ._local import ShardedOpError
from .halo import with_extent
from .indexing import RowPiece, axis_sharding, move_rows, offsets, pieces_from, sharded_slice

aten = torch.ops.aten

__all__ = ["cat_split"]


def _meta(spec: ShardTensorSpec, stride: Sequence[int]) -> torch.Tensor:
    return torch.empty_strided(spec.shape, stride, device="meta")


def _shifted(placements: Sequence[Placement], removed: Sequence[int]) -> list[Placement]:
    """Placements after deleting tensor dims ``removed`` (none of them sharded)."""
    return [Shard(p.dim - sum(d < p.dim for d in removed)) if type(p) is Shard else p for p in placements]


def _replicating(spec: ShardTensorSpec, axes: Sequence[int]) -> ShardTensorSpec:
    placements = [Replicate() if a in axes else p for a, p in enumerate(spec.placements)]
    sizes = [None if a in axes else s for a, s in enumerate(spec.axis_sizes)]
    return ShardTensorSpec(spec.mesh, placements, spec.shape, sizes, spec.stride)


def _move_to(tensor: ShardTensor, needed: ShardTensorSpec) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The slab under ``needed`` and its global stride (contiguous once moved)."""
    if needed == tensor._spec:
        return tensor._local_tensor, tensor._spec.stride
    return redistribute_local(tensor._local_tensor, tensor._spec, needed), contiguous_strides(needed.shape)


# ----- squeeze -------------------------------------------------------------------------------------------
def _squeeze_dims(op: torch._ops.OpOverload, args: tuple, shape: Sequence[int]) -> list[int]:
    ndim = len(shape)
    if op is aten.squeeze.default:
        candidates = range(ndim)
    elif op is aten.squeeze.dim:
        candidates = [args[1] % max(ndim, 1)]
    else:
        candidates = [d % max(ndim, 1) for d in args[1]]
    return sorted({d for d in candidates if ndim and shape[d] == 1})


def _squeeze_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    tensor = args[0]
    spec = tensor._spec
    dims = _squeeze_dims(op, args, spec.shape)
    sharded = [a for a, p in enumerate(spec.placements) if type(p) is Shard and p.dim in dims]
    needed = _replicating(spec, sharded)
    local, stride = _move_to(tensor, needed)
    out_stride = aten.squeeze.dims(_meta(spec, stride), dims).stride()
    shape = [n for d, n in enumerate(spec.shape) if d not in dims]
    out = ShardTensorSpec(spec.mesh, _shifted(needed.placements, dims), shape, needed.axis_sizes, out_stride)
    return ShardTensor(aten.squeeze.dims(local, dims), out)


# ----- expand --------------------------------------------------------------------------------------------
def _expand_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``expand`` of a size-1 dim split over ranks (one rank holds the row, the others none):
    that axis is replicated first, one row sent, so every rank broadcasts the row (DTensor has no
    rule: it raised).  The result is a view of the replicated row, as torch's is of the row."""
    tensor, sizes = args[0], args[1]
    spec = tensor._spec
    lead = len(sizes) - tensor.ndim
    widened = [
        axis for axis, p in enumerate(spec.placements)
        if type(p) is Shard and spec.shape[p.dim] == 1 and sizes[lead + p.dim] not in (1, -1)
    ]
    if widened:
        needed = _replicating(spec, widened)
        tensor = ShardTensor(redistribute_local(tensor._local_tensor, spec, needed), needed)
    return propagate_and_run(op, (tensor, *args[1:]), kwargs)


# ----- split / chunk -------------------------------------------------------------------------------------
def _split_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    tensor, split = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % tensor.ndim
    if axis_sharding(tensor._spec, dim) is None:
        return propagate_and_run(op, args, kwargs)
    lengths = [piece.shape[dim] for piece in op(torch.empty(tensor.shape, device="meta"), split, dim)]
    starts = offsets(lengths)
    return [sharded_slice(tensor, dim, start, start + n, 1) for start, n in zip(starts, lengths)]


# ----- unbind ---------------------------------------------------------------------------------------------
def _free_dim(spec: ShardTensorSpec, exclude: int, parts: int) -> int | None:
    """The largest dim no axis shards (other than ``exclude``) that can hold ``parts`` shards."""
    taken = {p.dim for p in spec.placements if type(p) is Shard}
    free = [d for d in range(spec.ndim) if d != exclude and d not in taken and spec.shape[d] >= parts]
    return max(free, key=lambda d: spec.shape[d], default=None)


def _unbind_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    spec = tensor._spec
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % tensor.ndim
    axis = axis_sharding(spec, dim)
    if axis is None:
        return propagate_and_run(op, args, kwargs)
    target = _free_dim(spec, dim, spec.mesh.size(axis))
    placements = list(spec.placements)
    sizes = list(spec.axis_sizes)
    placements[axis] = Replicate() if target is None else Shard(target)
    sizes[axis] = None if target is None else balanced_sizes(spec.shape[target], spec.mesh.size(axis))
    needed = ShardTensorSpec(spec.mesh, placements, spec.shape, sizes)
    local, stride = _move_to(tensor, needed)
    out_stride = _meta(spec, stride).select(dim, 0).stride()
    shape = [n for d, n in enumerate(spec.shape) if d != dim]
    out = ShardTensorSpec(spec.mesh, _shifted(placements, [dim]), shape, sizes, out_stride)
    return [ShardTensor(piece, out) for piece in local.unbind(dim)]


# ----- cat ------------------------------------------------------------------------------------------------
def cat_split(parts: Sequence[tuple[int, int, Sequence[int] | None]], total: int, ranks: int) -> list[int]:
    """The output split of a cat along a sharded dim; ``parts``: (base, extent, split or None if replicated).

    Each boundary may lie anywhere between the rows the ranks before it hold and the rows the
    ranks after it hold; the balanced boundary clamped into that window keeps every row in place.
    Where no such boundary exists, the balanced split.
    """
    balanced = offsets(balanced_sizes(total, ranks))
    bounds = [0]
    for r in range(1, ranks):
        low, high = 0, total
        for base, _, sizes in parts:
            if sizes is None:
                continue
            for p, (origin, size) in enumerate(zip(offsets(sizes), sizes)):
                if size and p < r:
                    low = max(low, base + origin + size)
                elif size:
                    high = min(high, base + origin)
        if low > high:
            return list(balanced_sizes(total, ranks))
        bounds.append(min(max(balanced[r], low, bounds[-1]), high))
    bounds.append(total)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _cat_pieces(parts: Sequence[tuple[int, int, Sequence[int] | None]], out_sizes: Sequence[int]) -> list[RowPiece]:
    pieces = []
    for dst, (origin, size) in enumerate(zip(offsets(out_sizes), out_sizes)):
        for k, (base, extent, sizes) in enumerate(parts):
            lo, hi = max(origin, base) - base, min(origin + size, base + extent) - base
            if hi <= lo:
                continue
            if sizes is None:
                pieces.append(RowPiece(k, dst, lo, hi - lo, dst))
            else:
                pieces += pieces_from(sizes, lo, hi, dst, k)
    return pieces


def _common_placement(tensors: Sequence[ShardTensor], axis: int) -> tuple[Placement, tuple[int, ...] | None]:
    """For an axis that does not shard the cat dim: the first input's non-replicated layout, else Replicate."""
    for t in tensors:
        if type(t.placements[axis]) is not Replicate:
            return t.placements[axis], t._spec.axis_sizes[axis]
    return Replicate(), None


def _cat_target(t: ShardTensor, dim: int, axis: int, common: dict) -> ShardTensorSpec:
    """Where input ``t`` must be before the rows move: Shard(dim) or Replicate on ``axis``, common elsewhere."""
    spec = t._spec
    placements, sizes = [], []
    for a in range(spec.mesh.ndim):
        if a != axis:
            placements.append(common[a][0])
            sizes.append(common[a][1])
        elif spec.placements[a] == Shard(dim):
            placements.append(Shard(dim))
            sizes.append(spec.axis_sizes[a])
        elif type(spec.placements[a]) is Shard:
            placements.append(Shard(dim))
            sizes.append(balanced_sizes(spec.shape[dim], spec.mesh.size(a)))
        else:
            placements.append(Replicate())
            sizes.append(None)
    return ShardTensorSpec(spec.mesh, placements, spec.shape, sizes)


def _as_shard_tensor(value: torch.Tensor, mesh: Any) -> ShardTensor:
    if isinstance(value, ShardTensor):
        return value
    return ShardTensor(value, ShardTensorSpec(mesh, [Replicate()] * mesh.ndim, value.shape))


def _split_alike(tensors: Sequence[ShardTensor]) -> bool:
    """Whether the inputs are split alike and laid out contiguously.  For a cat along a dim none of
    them shards (a U-Net's channel concat of its skip connection) the slabs then concatenate as they are."""
    first = tensors[0]._spec
    for t in tensors:
        spec = t._spec
        if spec.has_partial or spec.strided or not spec.is_contiguous():
            return False
        if spec.mesh is not first.mesh or spec.placements != first.placements or spec.axis_sizes != first.axis_sizes:
            return False
    return True


def _local_cat(tensors: Sequence[ShardTensor], dim: int) -> ShardTensor:
    """``cat`` of the slabs; the global shape grows along ``dim`` (torch checks the other dims on the slabs)."""
    first = tensors[0]._spec
    local = torch.cat([t._local_tensor for t in tensors], dim)
    shape = with_extent(first.shape, dim, sum(t.shape[dim] for t in tensors))
    return ShardTensor(local, ShardTensorSpec(first.mesh, first.placements, shape, first.axis_sizes))


def _cat_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    sharded = [t for t in args[0] if isinstance(t, ShardTensor)]
    ndim = sharded[0].ndim
    dim %= ndim
    axes = {a for t in sharded for a, p in enumerate(t.placements) if p == Shard(dim)}
    if not axes:
        if len(sharded) == len(args[0]) and _split_alike(sharded):
            return _local_cat(sharded, dim)
        return propagate_and_run(op, args, kwargs)
    if len(axes) > 1:
        reason = f"the inputs shard the cat dim {dim} over different mesh axes {sorted(axes)}; redistribute them alike"
        raise ShardedOpError("cat", sharded, reason)
    axis = axes.pop()
    mesh = sharded[0]._spec.mesh
    inputs = [_as_shard_tensor(t, mesh) for t in args[0] if not (t.ndim == 1 and t.shape[0] == 0 and ndim != 1)]
    common = {a: _common_placement(inputs, a) for a in range(mesh.ndim) if a != axis}
    targets = [_cat_target(t, dim, axis, common) for t in inputs]
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in inputs])
    locals_ = [redistribute_local(t._local_tensor, t._spec, s).to(dtype) for t, s in zip(inputs, targets)]
    extents = [t.shape[dim] for t in inputs]
    parts = [(base, n, s.axis_sizes[axis]) for base, n, s in zip(offsets(extents), extents, targets)]
    total = sum(extents)
    out_sizes = cat_split(parts, total, mesh.size(axis))
    local = move_rows(locals_, _cat_pieces(parts, out_sizes), dim, targets[0].coordinate()[axis], mesh.get_group(axis))
    shape = list(inputs[0].shape)
    shape[dim] = total
    placements = [Shard(dim) if a == axis else common[a][0] for a in range(mesh.ndim)]
    axis_sizes = [tuple(out_sizes) if a == axis else common[a][1] for a in range(mesh.ndim)]
    return ShardTensor(local, ShardTensorSpec(mesh, placements, shape, axis_sizes))


def _cat_keeping_grad_layouts(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """``torch.cat`` whose inputs take their gradients back in their own layouts when the cat dim is sharded."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    if torch.is_grad_enabled() and isinstance(tensors, (list, tuple)) and isinstance(dim, int):
        sharded = [t for t in tensors if isinstance(t, ShardTensor)]
        with torch._C.DisableTorchFunctionSubclass():  # requires_grad without a __torch_function__ round trip each
            needing_grad = [t for t in sharded if t.requires_grad]
        if any(Shard(dim % t._spec.ndim) in t.placements for t in needing_grad if t._spec.ndim):
            kept = [keep_grad_layout(t) if isinstance(t, ShardTensor) else t for t in tensors]
            if args:
                args = (kept, *args[1:])
            else:
                kwargs = {**kwargs, "tensors": kept}
    return run_default(func, args, kwargs)


# ----- pixel_unshuffle -------------------------------------------------------------------------------------
def _pixel_unshuffle_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Each factor x factor block becomes channels, so a slab must hold whole blocks.  A split of H
    or W that cuts blocks (H = 6 over 2 ranks as [3, 3]) moves to a balanced split of whole blocks
    first (a few rows travel); torch's kernel would raise on the slab although the grid divides."""
    x, factor = args[0], args[1]
    spec = x._spec
    axis_sizes = list(spec.axis_sizes)
    for axis, placement in enumerate(spec.placements):
        sizes = axis_sizes[axis]
        if type(placement) is not Shard or placement.dim < x.ndim - 2 or x.shape[placement.dim] % factor:
            continue
        if any(n % factor for n in sizes):
            axis_sizes[axis] = tuple(n * factor for n in balanced_sizes(x.shape[placement.dim] // factor, len(sizes)))
    if axis_sizes != list(spec.axis_sizes):
        aligned = ShardTensorSpec(spec.mesh, spec.placements, spec.shape, axis_sizes)
        x = ShardTensor(redistribute_local(x._local_tensor, spec, aligned), aligned)
    return propagate_and_run(op, (x, *args[1:]), kwargs)


# ----- registration ---------------------------------------------------------------------------------------
for _func in (torch.cat, torch.concat, torch.concatenate):
    ShardTensor.register_function_handler(_func, _cat_keeping_grad_layouts)
for _op in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
    ShardTensor.register_dispatch_handler(_op, _squeeze_handler)
for _op in (aten.split.Tensor, aten.split_with_sizes.default):
    ShardTensor.register_dispatch_handler(_op, _split_handler)
ShardTensor.register_dispatch_handler(aten.unbind.int, _unbind_handler)
ShardTensor.register_dispatch_handler(aten.expand.default, _expand_handler)
ShardTensor.register_dispatch_handler(aten.pixel_unshuffle.default, _pixel_unshuffle_handler)
ShardTensor.register_dispatch_handler(aten.cat.default, _cat_handler)
