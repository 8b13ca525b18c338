"""``scatter_tensor``: one rank holds a global tensor; every rank receives only its own slab."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import collectives
from .placements import Placement, normalize_placements
from .shard_tensor import ShardTensor
from .spec import ShardTensorSpec

__all__ = ["scatter_tensor"]

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


def _mesh_group(mesh: DeviceMesh):
    if mesh.ndim == 1:
        return mesh.get_group(0)
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    raise ValueError("scatter_tensor on a multi-axis mesh needs the mesh to span every rank")


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _broadcast_meta(tensor: torch.Tensor | None, is_src: bool, src_rank: int, mesh: DeviceMesh):
    """Shape and dtype travel from the source so only it needs to know them."""
    group = _mesh_group(mesh)
    meta = torch.zeros(17, dtype=torch.int64)
    if is_src:
        if tensor.ndim > 15:
            raise ValueError("scatter_tensor supports at most 15 dims")
        meta[0] = tensor.ndim
        meta[1] = _DTYPES.index(tensor.dtype)
        meta[2 : 2 + tensor.ndim] = torch.tensor(tensor.shape)
    collectives.broadcast(meta, dist.get_group_rank(group, src_rank), group)
    ndim = int(meta[0])
    return torch.Size(meta[2 : 2 + ndim].tolist()), _DTYPES[int(meta[1])]


def scatter_tensor(
    tensor: torch.Tensor | None,
    global_src: int,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
) -> ShardTensor:
    """Split ``tensor`` (needed on ``global_src`` only) over ``mesh`` with the balanced default split.

    The source sends each rank exactly its slab with point-to-point messages; nobody else
    ever holds the whole tensor.  Without ``global_shape``/``dtype`` the source broadcasts them.
    """
    me = dist.get_rank()
    is_src = me == global_src
    if is_src and tensor is None:
        raise ValueError(f"scatter_tensor: the source rank {global_src} must pass the tensor")
    if global_shape is None or dtype is None:
        shape, src_dtype = _broadcast_meta(tensor, is_src, global_src, mesh)
        global_shape = shape if global_shape is None else global_shape
        dtype = src_dtype if dtype is None else dtype
    placements = normalize_placements(placements, len(global_shape), mesh.ndim)
    if any(p.is_partial() for p in placements):
        raise ValueError("scatter_tensor takes Shard or Replicate placements; Partial has no source value to scatter")
    spec = ShardTensorSpec(mesh, placements, global_shape)
    device = tensor.device if is_src else _mesh_device(mesh)
    ranks = mesh.mesh
    sends: dict[int, torch.Tensor] = {}
    local: torch.Tensor | None = None
    if is_src:
        source = tensor.to(dtype)
        for coordinate in itertools.product(*(range(n) for n in ranks.shape)):
            slab = source
            for dim, (offset, size) in enumerate(zip(spec.offsets(coordinate), spec.local_shape(coordinate))):
                slab = slab.narrow(dim, offset, size)
            owner = int(ranks[coordinate])
            if owner == me:
                local = slab.contiguous().clone()
            else:
                sends[owner] = slab
    recv_shapes = {} if is_src or me not in ranks else {global_src: spec.local_shape()}
    received = collectives.exchange_with_neighbours(sends, recv_shapes, None, dtype=dtype, device=device)
    if local is None:
        local = received[global_src]
    result = ShardTensor(local, spec)
    if requires_grad:
        result.requires_grad_(True)
    return result
