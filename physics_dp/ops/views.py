"""``view`` / ``reshape`` of sharded tensors with uneven splits (flatten, unflatten, patchify).

A view regroups consecutive dims.  A sharded dim stays sharded when it leads its group (only
size-1 dims before it): each slab is then a contiguous block of the group's flattened index,
which the output's leading non-trivial dim of that group can describe, provided the block
boundaries fall on whole output rows.  Otherwise the split is first moved to the nearest
aligned one (an all-to-all of a few rows), and a sharded dim that does not lead its group
(e.g. W when flattening H x W with both sharded) is gathered on its axis.  DTensor refuses
all uneven cases; here they stay exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..shard_tensor import Replicate, Shard, ShardingRuleError, ShardTensor, ShardTensorSpec, balanced_sizes
from ..shard_tensor.redistribute import redistribute_local
from ..shard_tensor.spec import contiguous_strides

aten = torch.ops.aten

__all__ = ["view_groups", "plan_view"]


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


def plan_view(spec: ShardTensorSpec, out_shape: Sequence[int]) -> tuple[ShardTensorSpec, list]:
    """The input spec the view needs (maybe re-split or gathered) and the output placements/sizes."""
    in_shape = list(spec.shape)
    groups = view_groups(in_shape, out_shape)
    group_of = {d: g for g in groups for d in g[0]}
    in_placements = list(spec.placements)
    in_sizes = list(spec.axis_sizes)
    out: list = []
    for axis, placement in enumerate(spec.placements):
        if type(placement) is not Shard:
            out.append((placement, None))
            continue
        dim = placement.dim
        group_in, group_out = group_of[dim]
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


def _view_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    tensor, size = args[0], args[1]
    spec = tensor._spec
    if spec.shape.numel() == 0:
        raise ShardingRuleError(f"{op}: views of empty global tensors {tuple(spec.shape)} are not supported")
    out_shape = _resolve_size(size, spec.shape.numel())
    needed, out = plan_view(spec, out_shape)
    local = tensor._local_tensor
    stride = spec.stride
    if needed != spec:
        local = redistribute_local(local, spec, needed)  # returns a contiguous slab
        stride = contiguous_strides(spec.shape)
    out_stride = torch.empty_strided(spec.shape, stride, device="meta").view(out_shape).stride()
    out_spec = ShardTensorSpec(spec.mesh, [p for p, _ in out], out_shape, [s for _, s in out], out_stride)
    return ShardTensor(op(local, list(out_spec.local_shape())), out_spec)


for _op in (aten.view.default, aten._unsafe_view.default):
    ShardTensor.register_dispatch_handler(_op, _view_handler)
