"""Building blocks for sharded ops written as local computations with local autograd.

An op handler takes the slab out of its ShardTensor (differentiably), computes on plain local
tensors (with halos, statistics, ...), and wraps the local result back with the spec it
computed.  Parameters shared by every rank (plain tensors, or replicated ShardTensors) enter
through :func:`local_param`, whose backward sums the per-rank gradient contributions over the
mesh axes that split the data (bucketed at the end of backward, see :mod:`.grad_sums`), so
parameter gradients equal one device's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..shard_tensor import Replicate, Shard, ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import from_local_with_spec, function_output, shared_local, to_local
from ..shard_tensor.dtensor_params import is_dtensor_param, local_replica
from ..shard_tensor.redistribute import redistribute_local
from ..shard_tensor.spec import in_spec_order
from .grad_sums import SumGradOverGroups
from .memory_format import in_output_layout

__all__ = [
    "local_input",
    "local_param",
    "wrap_local",
    "wrap_local_as",
    "sharded_output",
    "sharded_axes",
    "data_axes",
    "sum_grad_over_axes",
    "groups_spanning",
    "groups_over",
    "ShardedOpError",
    "slab_as",
    "contiguous_result",
    "gather_rows",
]


class ShardedOpError(NotImplementedError):
    """A sharded op was called with an unsupported combination; the message says which and why."""

    def __init__(self, op: str, tensors: Sequence[ShardTensor], reason: str) -> None:
        layouts = ", ".join(f"{tuple(t.shape)} {list(t.placements)}" for t in tensors)
        super().__init__(f"{op} on ShardTensor(s) {layouts}: {reason}")


def local_input(tensor: ShardTensor) -> torch.Tensor:
    """The slab of ``tensor`` as a plain tensor in the local autograd graph (the same one for every
    op that reads ``tensor``: :func:`.conversions.shared_local`)."""
    return shared_local(tensor)


def sharded_axes(tensor: ShardTensor) -> list[tuple[int, int]]:
    """(mesh axis, tensor dim) for every axis that shards ``tensor``."""
    return [(axis, p.dim) for axis, p in enumerate(tensor.placements) if type(p) is Shard]


def data_axes(tensor: ShardTensor) -> list[int]:
    """Mesh axes whose ranks hold different data (sharded): parameter gradients sum over them."""
    return [axis for axis, _ in sharded_axes(tensor)]


def groups_spanning(mesh, axes: tuple[int, ...]) -> list:
    """Process groups whose successive sums cover ``axes``: one world-wide group when the axes
    are the whole mesh and the mesh is the whole job (one collective instead of one per axis)."""
    if len(axes) > 1 and len(axes) == mesh.ndim and mesh.size() == dist.get_world_size():
        return [dist.group.WORLD]
    return [mesh.get_group(axis) for axis in axes]


def groups_over(tensor: ShardTensor, dims: Sequence[int]) -> tuple:
    """Process groups spanning the mesh axes that shard any of ``dims`` of ``tensor`` (empty: none do)."""
    return tuple(groups_spanning(tensor.device_mesh, tuple(axis for axis, dim in sharded_axes(tensor) if dim in dims)))


def sum_grad_over_axes(tensor: torch.Tensor, mesh, axes: Sequence[int]) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``axes`` (each rank holds one share)."""
    if not axes or not (torch.is_grad_enabled() and tensor.requires_grad):
        return tensor
    return SumGradOverGroups.apply(tensor, tuple(groups_spanning(mesh, tuple(axes))))


def local_param(param: torch.Tensor | None, like: ShardTensor, axes: Sequence[int] | None = None) -> torch.Tensor | None:
    """A parameter for local compute beside the slab of ``like``.

    Each rank's local compute yields only its slab's share of the parameter gradient; the
    backward sums those shares over ``axes`` (default: every axis that splits ``like``; an op
    whose own backward already sums over some of them passes the rest).  Replicated
    ShardTensor and Replicate DTensor parameters are accepted too.
    """
    if param is None:
        return None
    if is_dtensor_param(param):
        param = local_replica(param)
    elif isinstance(param, ShardTensor):
        if any(type(p) is not Replicate for p in param.placements):
            raise ShardedOpError("parameter", [param], "parameters must be plain tensors or replicated ShardTensors")
        param = to_local(param)
    return sum_grad_over_axes(param, like.device_mesh, data_axes(like) if axes is None else axes)


def wrap_local(
    local: torch.Tensor, like: ShardTensor, shape: Sequence[int], axis_sizes: Sequence[Sequence[int] | None],
    order: Sequence[int] | None = None,
) -> ShardTensor:
    """Wrap a local result as a ShardTensor on ``like``'s mesh and placements with the given split,
    row-major or with its dims in memory as ``order`` (see :mod:`.memory_format`)."""
    return wrap_local_as(local, in_output_layout(ShardTensorSpec(like.device_mesh, like.placements, shape, axis_sizes), order))


def wrap_local_as(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """Wrap a local result as a ShardTensor of a dense ``spec`` (an op handler's output), laid out
    as the spec says (a copy only where it is not)."""
    if spec.local_shape() != local.shape:
        raise RuntimeError(f"local result of shape {tuple(local.shape)} does not match {spec}: a bug in the op handler")
    return from_local_with_spec(local, spec)


def sharded_output(ctx, y: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """An op Function's result ``y`` as the ShardTensor of ``spec``, returned by the Function itself: one
    autograd node per op, not a conversion node after it (its backward takes the slab's gradient
    back with ``conversions.slab_gradient(grad, ctx.out_spec)``)."""
    ctx.out_spec = spec
    return function_output(in_spec_order(y, spec), spec)


# ----- aten-level handlers (below autograd): slabs in, ShardTensors out ------------------------
def slab_as(tensor: ShardTensor, spec: ShardTensorSpec) -> torch.Tensor:
    """``tensor``'s slab laid out as ``spec`` (a gradient may arrive in another layout, a Partial
    input is reduced)."""
    if tensor._spec == spec:
        return tensor._local_tensor
    return redistribute_local(tensor._local_tensor, tensor._spec, spec)


def contiguous_result(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """A result of ``spec``'s placements and split, contiguous as torch's own kernels return it,
    whatever the input's memory layout."""
    return ShardTensor(local.contiguous(), spec.replace())


def gather_rows(rows: Sequence[torch.Tensor], group: ProcessGroup) -> list[list[torch.Tensor]]:
    """Every group rank's ``rows`` (equal shapes on all ranks), by group rank: one all-gather, the
    rows packed as bytes so that values and int64 indices travel together (each piece is copied out,
    as its bytes need not be aligned for its dtype)."""
    flat = torch.cat([r.contiguous().reshape(-1).view(torch.uint8) for r in rows])
    gathered = collectives.all_gather_rows(flat, group)
    sizes = [r.numel() * r.element_size() for r in rows]
    return [
        [piece.clone().view(r.dtype).view(r.shape) for piece, r in zip(torch.split(row, sizes), rows)]
        for row in gathered
    ]
