"""``view`` / ``reshape`` of sharded tensors with uneven splits (flatten, unflatten, patchify).

A view regroups consecutive dims.  A sharded dim stays sharded when it leads its group (only
size-1 dims before it): each slab is then a contiguous block of the group's flattened index,
which the output's leading non-trivial dim of that group can describe, provided the block
boundaries fall on whole output rows.  Otherwise the split is first moved to the nearest
aligned one (an all-to-all of a few rows).  A sharded dim that does not lead its group (W when
flattening H x W into tokens) makes the output dim strided (``StridedShard``): each slab is the
flatten of its own block, nothing moves, and the inverse view (unpatchify) restores both shards.
A strided dim that a view merges with other dims takes a contiguous layout first (W gathered).
DTensor refuses all uneven cases; here they stay exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..shard_tensor import Replicate, Shard, ShardingRuleError, ShardTensor, ShardTensorSpec, balanced_sizes
from ..shard_tensor.placements import StridedShard
from ..shard_tensor.redistribute import contiguous_layout, redistribute_local
from ..shard_tensor.spec import contiguous_strides

aten = torch.ops.aten

__all__ = ["view_groups", "plan_view", "view_spec_in_place"]


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split both shapes into consecutive blocks of dims with equal products."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        group_in: list[int] = []
        group_out: list[int] = []
        product_in = product_out = 1
        if i < len(in_shape):
            group_in.append(i)
            product_in *= in_shape[i]
            i += 1
        if j < len(out_shape):
            group_out.append(j)
            product_out *= out_shape[j]
            j += 1
        while product_in != product_out:
            if product_in < product_out:
                group_in.append(i)
                product_in *= in_shape[i]
                i += 1
            else:
                group_out.append(j)
                product_out *= out_shape[j]
                j += 1
        groups.append((group_in, group_out))
    return groups


def _resolve_size(size: Sequence[int], numel: int) -> list[int]:
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = numel // known
    return size


def _strided_group(spec: ShardTensorSpec, group_in: list[int], non1_out: list[int]) -> bool:
    """Whether a group's flatten keeps its shards as a strided dim: a sharded dim that does not
    lead the group (a contiguous range would need W gathered), merged into one output dim."""
    in_shape = spec.shape
    sharded = [p.dim for p in spec.placements if type(p) is Shard and p.dim in group_in and in_shape[p.dim] > 1]
    leading = next((d for d in group_in if in_shape[d] > 1), None)
    return len(non1_out) == 1 and any(d != leading for d in sharded)


def _plan_strided_dims(spec: ShardTensorSpec, groups, out_shape: Sequence[int]) -> dict[int, tuple] | None:
    """Output (placement, sizes) of each axis on a strided input dim; None where the view regroups
    a strided dim with others (it must first take a contiguous layout)."""
    in_shape = spec.shape
    group_of = {d: g for g in groups for d in g[0]}
    out: dict[int, tuple] = {}
    for axis, placement in enumerate(spec.placements):
        if type(placement) is not StridedShard:
            continue
        group_in, group_out = group_of[placement.dim]
        non1_in = [d for d in group_in if in_shape[d] > 1]
        non1_out = [d for d in group_out if out_shape[d] > 1]
        sizes = spec.axis_sizes[axis]
        if non1_in != [placement.dim]:
            return None
        if len(non1_out) == 1:  # the dim keeps its extent: only its position changes
            out[axis] = (StridedShard(non1_out[0], placement.factors, placement.factor), sizes)
        elif [out_shape[d] for d in non1_out] == list(placement.factors):  # unflattened into its factors
            out[axis] = (Shard(non1_out[placement.factor]), sizes)
        else:
            return None
    return out


def plan_view(spec: ShardTensorSpec, out_shape: Sequence[int]) -> tuple[ShardTensorSpec, list]:
    """The input spec the view needs (maybe re-split or gathered) and the output placements/sizes."""
    in_shape = list(spec.shape)
    groups = view_groups(in_shape, out_shape)
    if spec.strided:
        strided_out = _plan_strided_dims(spec, groups, out_shape)
        if strided_out is None:
            spec = contiguous_layout(spec)
            strided_out = {}
    else:
        strided_out = {}
    group_of = {d: g for g in groups for d in g[0]}
    in_placements = list(spec.placements)
    in_sizes = list(spec.axis_sizes)
    out: list = []
    for axis, placement in enumerate(spec.placements):
        if axis in strided_out:
            out.append(strided_out[axis])
            continue
        if type(placement) is not Shard:
            out.append((placement, None))
            continue
        dim = placement.dim
        group_in, group_out = group_of[dim]
        non1_out = [d for d in group_out if out_shape[d] > 1]
        if _strided_group(spec, group_in, non1_out):
            factors = tuple(in_shape[d] for d in group_in if in_shape[d] > 1)
            if in_shape[dim] > 1:
                factor = [d for d in group_in if in_shape[d] > 1].index(dim)
                out.append((StridedShard(non1_out[0], factors, factor), spec.axis_sizes[axis]))
                continue
        leading = all(in_shape[d] == 1 for d in group_in if d < dim)
        if not leading:
            in_placements[axis], in_sizes[axis] = Replicate(), None
            out.append((Replicate(), None))
            continue
        inner_in = math.prod(in_shape[d] for d in group_in if d > dim)
        out_dim = next((d for d in group_out if out_shape[d] > 1), group_out[0])
        inner_out = math.prod(out_shape[d] for d in group_out if d > out_dim)
        unit = inner_out // math.gcd(inner_in, inner_out)  # rows of `dim` per whole output row
        sizes = spec.axis_sizes[axis]
        if any(s % unit for s in sizes):
            sizes = tuple(n * unit for n in balanced_sizes(in_shape[dim] // unit, len(sizes)))
            in_sizes[axis] = sizes
        out.append((Shard(out_dim), tuple(s * inner_in // inner_out for s in sizes)))
    needed = ShardTensorSpec(spec.mesh, in_placements, in_shape, in_sizes, spec.stride)
    return needed, out


# A view's plan depends on the input's layout and the output shape only.  The cache holds no
# mesh: a mesh holds its process groups, and a module-level reference would keep destroyed groups
# alive until interpreter exit.
# (placements, shape, axis sizes, stride, mesh shape, output shape) -> (the re-split the view
# needs or None, the output's placements, shape, axis sizes and stride)
_VIEW_PLANS: dict[tuple, tuple[tuple | None, tuple]] = {}
_VIEW_PLAN_LIMIT = 4096


def _view_plan(spec: ShardTensorSpec, out_shape: Sequence[int]) -> tuple[ShardTensorSpec, ShardTensorSpec]:
    """(the input spec the view needs, the output spec): once per spec object and shape, else from
    the plans per layout and shape (3 us less per view: no key of the layout, no spec rebuilt)."""
    shape = tuple(out_shape)
    return spec.derived(("view", shape), lambda: _planned_view(spec, shape))


def _planned_view(spec: ShardTensorSpec, out_shape: tuple[int, ...]) -> tuple[ShardTensorSpec, ShardTensorSpec]:
    key = (spec.placements, spec.shape, spec.axis_sizes, spec.stride, tuple(spec.mesh.shape), out_shape)
    plan = _VIEW_PLANS.get(key)
    if plan is None:
        needed, out = plan_view(spec, out_shape)
        stride = spec.stride if needed == spec else contiguous_strides(spec.shape)
        out_stride = torch.empty_strided(spec.shape, stride, device="meta").view(out_shape).stride()
        out_spec = ShardTensorSpec(spec.mesh, [p for p, _ in out], out_shape, [s for _, s in out], out_stride)
        fields = (out_spec.placements, out_spec.shape, out_spec.axis_sizes, out_spec.stride)
        if len(_VIEW_PLANS) >= _VIEW_PLAN_LIMIT:
            _VIEW_PLANS.clear()
        _VIEW_PLANS[key] = (None if needed == spec else (needed.placements, needed.axis_sizes), fields)
        return needed, out_spec
    resplit, fields = plan
    needed = spec if resplit is None else ShardTensorSpec(spec.mesh, resplit[0], spec.shape, resplit[1], spec.stride)
    return needed, ShardTensorSpec.from_checked(spec.mesh, *fields)


def view_spec_in_place(spec: ShardTensorSpec, out_shape: Sequence[int]) -> ShardTensorSpec | None:
    """The layout of ``view(out_shape)`` of a tensor laid out as ``spec`` where no rows need to move
    (each slab views as itself), else None.  For handlers that reshape slabs they hold as plain
    tensors: one planned spec instead of a dispatched view (and its backward) per reshape."""
    needed, out_spec = _view_plan(spec, out_shape)
    return out_spec if needed == spec else None


def _view_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    tensor, size = args[0], args[1]
    spec = tensor._spec
    if spec.shape.numel() == 0:
        raise ShardingRuleError(f"{op}: views of empty global tensors {tuple(spec.shape)} are not supported")
    needed, out_spec = _view_plan(spec, _resolve_size(size, spec.shape.numel()))
    local = tensor._local_tensor
    if needed != spec:
        local = redistribute_local(local, spec, needed)  # returns a contiguous slab
    local_shape = list(out_spec.local_shape())
    try:
        return ShardTensor(op(local, local_shape), out_spec)
    except RuntimeError:
        # The global layout allows the view but this slab's own strides do not: an op chose a
        # different memory order for the slab than for the global shape (seen on gradients in a
        # double backward over strided tokens).  Copy rather than fail; the result then does not
        # alias the input, so an in-place write through it would not reach the input.
        if local.is_contiguous() or not local.numel():
            raise
        return ShardTensor(local.reshape(local_shape), out_spec)


for _op in (aten.view.default, aten._unsafe_view.default):
    ShardTensor.register_dispatch_handler(_op, _view_handler)
    ShardTensor.register_strided_handler(_op, _view_handler)
