"""Moving a local slab from one spec to another: the plan and the collectives that run it.

Each mesh axis changes independently (different axes shard different tensor dims), so a
redistribution is a sequence of single-axis steps.  A step that would shard a dim still
sharded by another axis waits until that axis has moved; if every pending step waits, one
axis is replicated first.  Sizes are explicit throughout, so uneven and empty shards need no
padding and never fall back to the ``torch.chunk`` layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..distributed import collectives
from .placements import Partial, Placement, Replicate, Shard, StridedShard, partial_op
from .spec import ShardTensorSpec, in_spec_order

__all__ = ["redistribute_local", "without_partials", "contiguous_layout"]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, running = [], 0
    for s in sizes:
        out.append(running)
        running += s
    return out


def _shard_to_replicate(local: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    return collectives.all_gather_along_dim(local, sizes, dim, group)


def _replicate_to_shard(local: torch.Tensor, dim: int, sizes: Sequence[int], coord: int) -> torch.Tensor:
    """This rank's rows in storage of their own: a view would keep the whole replicated tensor
    alive (a slab of dim 0 is a contiguous view) and alias it for in-place updates.

    Except a broadcast tensor (stride 0, as the gradient of a sum or mean arrives): its rows share
    stored rows, so there is little to keep alive, and torch refuses in-place writes to them.
    Copying would write the whole slab (2.1 ms of a 19 ms mean-of-squares step on 2 ranks).
    """
    rows = local.narrow(dim, _offsets(sizes)[coord], sizes[coord])
    if _broadcast(local):
        return rows
    return rows.clone(memory_format=torch.contiguous_format)


def _broadcast(local: torch.Tensor) -> bool:
    """Whether some dim of ``local`` repeats one stored row (stride 0), as an expanded tensor does."""
    return any(stride == 0 and extent > 1 for stride, extent in zip(local.stride(), local.shape))


def _reshard_same_dim(
    local: torch.Tensor, dim: int, src: Sequence[int], dst: Sequence[int], coord: int, group
) -> torch.Tensor:
    """Move rows of one dim between ranks so that the split changes from ``src`` to ``dst``."""
    src_off, dst_off = _offsets(src), _offsets(dst)
    my_start, my_end = src_off[coord], src_off[coord] + src[coord]
    sends, recv_shapes = [], []
    for peer in range(len(src)):
        start = max(my_start, dst_off[peer])
        end = min(my_end, dst_off[peer] + dst[peer])
        sends.append(local.narrow(dim, start - my_start, max(0, end - start)) if end > start else local.narrow(dim, 0, 0))
        recv_start = max(src_off[peer], dst_off[coord])
        recv_end = min(src_off[peer] + src[peer], dst_off[coord] + dst[coord])
        shape = list(local.shape)
        shape[dim] = max(0, recv_end - recv_start)
        recv_shapes.append(shape)
    return collectives.all_to_all_joined(sends, recv_shapes, dim, group)


def _reshard_other_dim(
    local: torch.Tensor,
    src_dim: int,
    src: Sequence[int],
    dst_dim: int,
    dst: Sequence[int],
    coord: int,
    group,
) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim) in one all-to-all: split along dst_dim, join along src_dim."""
    dst_off = _offsets(dst)
    sends = [local.narrow(dst_dim, dst_off[p], dst[p]) for p in range(len(dst))]
    recv_shapes = []
    for peer in range(len(src)):
        shape = list(local.shape)
        shape[src_dim] = src[peer]
        shape[dst_dim] = dst[coord]
        recv_shapes.append(shape)
    return collectives.all_to_all_joined(sends, recv_shapes, src_dim, group)


def _reduce_pieces(pieces: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(pieces)
    op = collectives.reduce_op_for(op, stacked.dtype)
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    if op == "product":
        return stacked.prod(0)
    if op == "max":
        return stacked.amax(0)
    return stacked.amin(0)


def _partial_to_shard(local: torch.Tensor, op: str, dim: int, dst: Sequence[int], coord: int, group) -> torch.Tensor:
    """Reduce-scatter as one all-to-all plus a local reduction (exact for every reduce op)."""
    dst_off = _offsets(dst)
    sends = [local.narrow(dim, dst_off[p], dst[p]) for p in range(len(dst))]
    shape = list(local.shape)
    shape[dim] = dst[coord]
    pieces = collectives.all_to_all_chunks(sends, [shape] * len(dst), group)
    return _reduce_pieces(pieces, op).to(local.dtype)


def _replicate_to_partial(local: torch.Tensor, op: str, coord: int) -> torch.Tensor:
    """One rank keeps the value, the others the reduction's identity (max, min, avg: the value itself)."""
    if op == "sum" and coord != 0:
        return torch.zeros_like(local, memory_format=torch.contiguous_format)
    if op == "product" and coord != 0:
        return torch.ones_like(local, memory_format=torch.contiguous_format)
    return local.contiguous()


class _State:
    """Placements and sizes of the slab as steps are applied."""

    def __init__(self, spec: ShardTensorSpec) -> None:
        self.placements: list[Placement] = list(spec.placements)
        self.sizes: list[tuple[int, ...] | None] = list(spec.axis_sizes)

    def dim_is_free(self, dim: int, axis: int) -> bool:
        return all(
            not (type(p) is Shard and p.dim == dim) for a, p in enumerate(self.placements) if a != axis  # type: ignore[attr-defined]
        )


def _step(local: torch.Tensor, state: _State, axis: int, target: Placement, target_sizes, spec) -> torch.Tensor:
    """Apply one single-axis transition in place of ``state``; return the new local slab."""
    mesh = spec.mesh
    group = mesh.get_group(axis)
    coord = spec.coordinate()[axis]
    current = state.placements[axis]
    sizes = state.sizes[axis]
    if type(current) is Shard:
        if type(target) is Shard:
            if target.dim == current.dim:
                local = _reshard_same_dim(local, current.dim, sizes, target_sizes, coord, group)
            else:
                local = _reshard_other_dim(local, current.dim, sizes, target.dim, target_sizes, coord, group)
        else:
            local = _shard_to_replicate(local, current.dim, sizes, group)
            if type(target) is Partial:
                local = _replicate_to_partial(local, partial_op(target), coord)
    elif type(current) is Partial:
        op = partial_op(current)
        if type(target) is Shard:
            local = _partial_to_shard(local, op, target.dim, target_sizes, coord, group)
        else:
            local = collectives.all_reduce(local, op, group)
            if type(target) is Partial:
                local = _replicate_to_partial(local, partial_op(target), coord)
    else:  # Replicate
        if type(target) is Shard:
            local = _replicate_to_shard(local, target.dim, target_sizes, coord)
        elif type(target) is Partial:
            local = _replicate_to_partial(local, partial_op(target), coord)
    state.placements[axis] = target
    state.sizes[axis] = target_sizes
    return local


def redistribute_local(local: torch.Tensor, src: ShardTensorSpec, dst: ShardTensorSpec) -> torch.Tensor:
    """The local slab of ``dst`` given the local slab of ``src`` (same mesh, same global shape)."""
    if src.shape != dst.shape:
        raise ValueError(f"cannot redistribute between different global shapes {tuple(src.shape)} and {tuple(dst.shape)}")
    if src.mesh is not dst.mesh and src.mesh != dst.mesh:
        raise ValueError("redistribute across different device meshes is not supported")
    if (src.strided or dst.strided) and src != dst:
        return _redistribute_strided(local, src, dst)
    state = _State(src)
    pending = [
        axis
        for axis in range(src.mesh.ndim)
        if (src.placements[axis], src.axis_sizes[axis]) != (dst.placements[axis], dst.axis_sizes[axis])
    ]
    if not pending:
        # nothing moves: keep the very slab (in-place ops then write through) unless only the
        # layout differs
        return local if dst.stride == src.stride else in_spec_order(local, dst)
    while pending:
        ready = [
            axis
            for axis in pending
            if type(dst.placements[axis]) is not Shard or state.dim_is_free(dst.placements[axis].dim, axis)  # type: ignore[attr-defined]
        ]
        if ready:
            axis = ready[0]
            local = _step(local, state, axis, dst.placements[axis], dst.axis_sizes[axis], src)
            pending.remove(axis)
        else:
            # Every pending step wants a dim another pending axis still shards: unblock by replicating.
            axis = next(a for a in pending if type(state.placements[a]) is Shard)
            local = _step(local, state, axis, Replicate(), None, src)
    # a broadcast slab (the gradient of a sum or mean) stays a view: its copy would write the whole slab
    return local if _broadcast(local) and dst.is_contiguous() else in_spec_order(local, dst)


def without_partials(spec: ShardTensorSpec) -> ShardTensorSpec:
    """``spec`` with its pending reductions applied (``Partial`` axes replicated).

    The layout a gradient takes for an input of ``spec``: the gradient of a ``Partial`` tensor is
    the gradient of its reduced value, which every contributing rank needs in full.  Also what an
    op that is not linear (a softmax) needs of its input.
    """
    if not spec.has_partial:
        return spec
    placements = [Replicate() if p.is_partial() else p for p in spec.placements]
    return ShardTensorSpec(spec.mesh, placements, spec.shape, spec.axis_sizes)


# ----- strided dims ---------------------------------------------------------------------------
# A strided dim is the row-major flatten of its factors, so splitting it into them (a view of
# the slab) turns every StridedShard into a Shard of one factor dim; the plain machinery above
# then moves the data, and the result is flattened back.


def contiguous_layout(spec: ShardTensorSpec) -> ShardTensorSpec:
    """The nearest layout without strided dims: a strided dim stays split by the axis of its
    leading factor (a contiguous range of the flattened dim) and is gathered on the others."""
    if not spec.strided:
        return spec
    placements, sizes = list(spec.placements), list(spec.axis_sizes)
    for axis, placement in enumerate(spec.placements):
        if type(placement) is StridedShard:
            if placement.factor == 0:
                inner = spec.shape[placement.dim] // placement.factors[0]
                placements[axis], sizes[axis] = Shard(placement.dim), tuple(n * inner for n in sizes[axis])
            else:
                placements[axis], sizes[axis] = Replicate(), None
    return ShardTensorSpec(spec.mesh, placements, spec.shape, sizes)


def _factors_by_dim(spec: ShardTensorSpec) -> dict[int, tuple[int, ...]]:
    return {p.dim: p.factors for p in spec.placements if type(p) is StridedShard}


def _expand(spec: ShardTensorSpec, factors: dict[int, tuple[int, ...]]) -> ShardTensorSpec | None:
    """``spec`` over the shape with each dim of ``factors`` split into them; None where an axis
    splits such a dim at boundaries that are not whole rows of its leading factor."""
    new_dim, shape, running = {}, [], 0
    for dim, extent in enumerate(spec.shape):
        new_dim[dim] = running
        parts = factors.get(dim, (extent,))
        shape.extend(parts)
        running += len(parts)
    placements, sizes = [], []
    for axis, placement in enumerate(spec.placements):
        axis_sizes = spec.axis_sizes[axis]
        if type(placement) is StridedShard:
            placements.append(Shard(new_dim[placement.dim] + placement.factor))
        elif type(placement) is Shard and placement.dim in factors:
            inner = spec.shape[placement.dim] // factors[placement.dim][0]
            if any(n % inner for n in axis_sizes):  # type: ignore[union-attr]
                return None
            placements.append(Shard(new_dim[placement.dim]))
            axis_sizes = tuple(n // inner for n in axis_sizes)  # type: ignore[union-attr]
        elif type(placement) is Shard:
            placements.append(Shard(new_dim[placement.dim]))
        else:
            placements.append(placement)
        sizes.append(axis_sizes)
    return ShardTensorSpec(spec.mesh, placements, shape, sizes)


def _replicating_axes(spec: ShardTensorSpec, dims: set[int]) -> ShardTensorSpec:
    placements = [Replicate() if type(p) is Shard and p.dim in dims else p for p in spec.placements]
    sizes = [None if type(p) is Shard and p.dim in dims else s for p, s in zip(spec.placements, spec.axis_sizes)]
    return ShardTensorSpec(spec.mesh, placements, spec.shape, sizes)


def _redistribute_strided(local: torch.Tensor, src: ShardTensorSpec, dst: ShardTensorSpec) -> torch.Tensor:
    factors = _factors_by_dim(dst)
    for dim, parts in _factors_by_dim(src).items():
        if factors.setdefault(dim, parts) != parts:  # two different factorings: meet in a plain layout
            plain = contiguous_layout(src)
            return redistribute_local(redistribute_local(local, src, plain), plain, dst)
    src_expanded = _expand(src, factors)
    if src_expanded is None:  # src splits a dim dst factors at ragged rows: gather those axes first
        plain = _replicating_axes(src, set(factors))
        return redistribute_local(redistribute_local(local, src, plain), plain, dst)
    landing = dst
    dst_expanded = _expand(dst, factors)
    if dst_expanded is None:  # dst splits a factored dim at ragged rows: land replicated, then cut
        landing = _replicating_axes(dst, set(factors))
        dst_expanded = _expand(landing, factors)
    moved = redistribute_local(local.reshape(src_expanded.local_shape()), src_expanded, dst_expanded)
    result = moved.reshape(landing.local_shape())
    return result if landing is dst else redistribute_local(result, landing, dst)
