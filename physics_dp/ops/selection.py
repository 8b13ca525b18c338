"""topk over a sharded dim, by candidates: each rank sends about k rows, not its slab.

DTensor's rule for topk replicates the selected dim, so every rank receives every other rank's slab.
The k largest (or smallest) of a dim are among the k largest of the slab that holds each of them, so
each rank takes the top ``min(k, slab)`` of its slab and sends those candidates' values and global
indices (the slab's offset added, from the spec's split) in one all-gather; indices travel in the
narrowest integer dtype that holds the dim.  Every rank then takes the top k of the candidates.  Where
k covers every slab the candidates are the slabs themselves: those travel without indices and the
result is torch's topk of the whole dim.  Both results are replicated along the mesh axis that sharded
the dim; the other axes keep their placements and split.

NaN counts as largest at both levels, as in torch, so the candidates hold the global answer.  Values
always equal one device's; torch's CPU topk orders ties as its selection algorithm leaves them (not
documented, not stable), so where values tie an index may name another of the equal elements than one
device's (it always names an element of that value).  With ``sorted=False`` the order is unspecified,
as in torch.

Backward (``autograd.Function`` at the function level: torch's formula scatters into a zeros tensor of
the global shape): the values' gradient is replicated along the axis, so each rank scatters into a
zeros slab the entries whose global index lies in its own range, with no communication; it refuses a
double backward.

Without a sharded selected dim, topk runs on the slab, forward and backward, with no communication.
DTensor's rule would too, but in torch 2.13 its propagation cache ignores k: a second topk over the same
dim with another k gets the first one's output shape (our fallback then raises).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from ..distributed import collectives
from ..distributed.axis_groups import group_over_axes
from ..shard_tensor import Replicate, ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import from_local_with_spec, redistribute_to_spec, to_local
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.fallback import propagate_and_run
from ..shard_tensor.redistribute import without_partials
from ._local import contiguous_result, gather_rows, slab_as
from .indexing import axis_splitting

__all__: list[str] = []

Selection = tuple[torch.Tensor, torch.Tensor]  # (values, global indices)


def _bind(
    input: object, k: object, dim: object = None, largest: bool = True, sorted: bool = True, out: object = None
) -> tuple:
    """``(input, k, dim, largest, sorted, out)`` of a ``torch.topk`` / ``Tensor.topk`` / ``aten.topk`` call."""
    return input, k, -1 if dim is None else dim, largest, sorted, out


def _plan(x: object, k: object, dim: object) -> tuple[int, int | None] | None:
    """``(dim made non-negative, the mesh axis that shards it over more than one rank, or None)`` for a
    call on a ShardTensor; None for a call with arguments torch refuses (the fallback lets torch say why)."""
    if not (isinstance(x, ShardTensor) and isinstance(k, int) and isinstance(dim, int) and -x.ndim <= dim < x.ndim):
        return None
    dim %= x.ndim
    return dim, axis_splitting(x._spec, dim)


def _out_spec(spec: ShardTensorSpec, dim: int, k: int) -> ShardTensorSpec:
    """The result's layout: ``dim`` of extent k and replicated (a size-1 axis sharding it holds it whole);
    other axes unchanged."""
    placements = [Replicate() if spec.shard_dim(a) == dim else p for a, p in enumerate(spec.placements)]
    axis_sizes = [None if spec.shard_dim(a) == dim else s for a, s in enumerate(spec.axis_sizes)]
    shape = [k if d == dim else s for d, s in enumerate(spec.shape)]
    return ShardTensorSpec(spec.mesh, placements, shape, axis_sizes)


def _index_dtype(extent: int) -> torch.dtype:
    """The narrowest integer dtype holding every index below ``extent``: candidate indices travel in it."""
    for dtype in (torch.int16, torch.int32):
        if extent <= torch.iinfo(dtype).max + 1:
            return dtype
    return torch.int64


def _padded(tensor: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``tensor`` with filler rows appended along ``dim`` up to ``rows`` (all ranks send equal shapes;
    every rank knows the split, so nobody reads the filler)."""
    missing = rows - tensor.shape[dim]
    if not missing:
        return tensor
    return torch.cat([tensor, tensor.new_zeros([missing if d == dim else s for d, s in enumerate(tensor.shape)])], dim)


def _topk_slab(
    local: torch.Tensor, k: int, dim: int, largest: bool, sorted_: bool, spec: ShardTensorSpec, axis: int | None
) -> Selection:
    """This rank's slab of the global (values, indices): over a dim sharded along ``axis``, the top k of
    every rank's candidates (replicated along ``axis``), else the slab's own topk."""
    if axis is None:  # the slab holds the whole dim
        return torch.topk(local, k, dim, largest, sorted_)
    if not 0 <= k <= spec.shape[dim]:
        raise RuntimeError("selected index k out of range")  # torch's words, raised on every rank alike
    sizes = spec.axis_sizes[axis]
    # every rank runs torch's topk on its slab first, so an unsupported dtype raises on all of them
    values, indices = torch.topk(local, min(k, local.shape[dim]), dim, largest, sorted=False)
    out_shape = [k if d == dim else s for d, s in enumerate(local.shape)]
    if 0 in out_shape:  # k == 0, or another dim is empty on every rank of the group
        return values.new_empty(out_shape), indices.new_empty(out_shape)
    group, members = group_over_axes(spec.mesh, (axis,))
    if k >= max(sizes):  # every slab is a candidate whole: gather the slabs, their indices implicit
        return torch.topk(collectives.all_gather_along_dim(local, sizes, dim, group), k, dim, largest, sorted_)
    counts = [min(k, s) for s in sizes]
    rows = max(counts)
    global_indices = (indices + spec.offsets()[dim]).to(_index_dtype(spec.shape[dim]))
    gathered = gather_rows([_padded(values, dim, rows), _padded(global_indices, dim, rows)], group)
    by_coordinate = {member[axis]: pieces for member, pieces in zip(members, gathered)}
    candidates = [
        [piece.narrow(dim, 0, counts[c]) for piece in by_coordinate[c]] for c in range(len(sizes)) if counts[c]
    ]
    best, positions = torch.topk(torch.cat([v for v, _ in candidates], dim), k, dim, largest, sorted_)
    return best, torch.cat([i for _, i in candidates], dim).long().gather(dim, positions)


def _topk(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[ShardTensor, ShardTensor]:
    x, k, dim, largest, sorted_, _ = _bind(*args, **kwargs)
    plan = _plan(x, k, dim)
    if plan is None:
        return propagate_and_run(op, args, kwargs)
    dim, axis = plan
    spec = without_partials(x._spec)
    values, indices = _topk_slab(slab_as(x, spec), k, dim, largest, sorted_, spec, axis)
    out_spec = _out_spec(spec, dim, k)
    return contiguous_result(values, out_spec), contiguous_result(indices, out_spec)


# ----- backward ------------------------------------------------------------------------------------
class _TopK(torch.autograd.Function):
    """topk on the slab (by candidates over a sharded dim); backward: each rank keeps the gradient of its
    own elements, with no communication."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        local: torch.Tensor,
        k: int,
        dim: int,
        largest: bool,
        sorted_: bool,
        spec: ShardTensorSpec,
        axis: int | None,
    ) -> Selection:
        values, indices = _topk_slab(local, k, dim, largest, sorted_, spec, axis)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.dim, ctx.spec = dim, spec
        return values, indices

    @staticmethod
    @once_differentiable  # the gradient of the replicated values is not summed over ranks: no double backward
    def backward(ctx, grad: torch.Tensor, _: torch.Tensor):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        return _scatter_own(grad, indices, ctx.dim, ctx.spec), None, None, None, None, None, None


def _scatter_own(grad: torch.Tensor, indices: torch.Tensor, dim: int, spec: ShardTensorSpec) -> torch.Tensor:
    """A zeros slab holding the entries of ``grad`` whose global index falls in this rank's range."""
    result = grad.new_zeros(spec.local_shape())
    start, extent = spec.offsets()[dim], result.shape[dim]
    if extent and grad.numel():
        own = (indices >= start) & (indices < start + extent)
        # topk's indices differ along dim, so only other ranks' entries (added as zeros) share a target
        result.scatter_add_(dim, (indices - start).clamp_(0, extent - 1), grad.where(own, 0))
    return result


def _topk_function(func: Callable, types: tuple, args: tuple, kwargs: dict) -> object:
    try:
        x, k, dim, largest, sorted_, out = _bind(*args, **kwargs)
    except TypeError:  # a call torch refuses: let it say why
        return run_default(func, args, kwargs)
    plan = _plan(x, k, dim)
    if plan is None or out is not None or not (torch.is_grad_enabled() and x.requires_grad):
        return run_default(func, args, kwargs)  # no gradient needed: the aten handler above
    dim, axis = plan
    spec = without_partials(x._spec)
    local = to_local(redistribute_to_spec(x, spec))
    values, indices = _TopK.apply(local, k, dim, largest, sorted_, spec, axis)
    out_spec = _out_spec(spec, dim, k)
    return torch.return_types.topk((from_local_with_spec(values, out_spec), from_local_with_spec(indices, out_spec)))


ShardTensor.register_dispatch_handler(torch.ops.aten.topk.default, _topk)
for _func in (torch.topk, torch.Tensor.topk):
    ShardTensor.register_function_handler(_func, _topk_function)
