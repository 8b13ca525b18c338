"""Shared test data for ShardTensor tests: meshes, shapes, exact global tensors, placements."""

from __future__ import annotations

import math

import itertools

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

# (mesh shape) x world size; the 2x2 mesh exercises two mesh axes.
MESHES = [(1,), (2,), (3,), (4,), (2, 2)]
# even for 1,2,3,4 ranks; uneven; extents smaller than the mesh (empty shards).
SHAPES = {"even": (12, 12), "uneven": (7, 5), "tiny": (2, 3)}


def world_of(mesh_shape: tuple[int, ...]) -> int:
    return math.prod(mesh_shape)


def global_tensor(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Small integer values in float32, so sums and averages are exact."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).float()


def axis_placements(ndim: int, partial_ops: tuple[str, ...]) -> list:
    return [Shard(d) for d in range(ndim)] + [Replicate()] + [Partial(op) for op in partial_ops]


def placement_combos(mesh_ndim: int, ndim: int, partial_ops: tuple[str, ...] | None = None) -> list[tuple]:
    """Every valid placements tuple (no tensor dim sharded twice).

    By default all four reductions on 1-D meshes; on 2-D meshes sum and max (one linear, one
    not) keep the number of pairs, which grows with the square of the combos, affordable.
    """
    if partial_ops is None:
        partial_ops = ("sum", "avg", "max", "min") if mesh_ndim == 1 else ("sum", "max")
    combos = []
    for combo in itertools.product(axis_placements(ndim, partial_ops), repeat=mesh_ndim):
        dims = [p.dim for p in combo if isinstance(p, Shard)]
        if len(dims) == len(set(dims)):
            combos.append(combo)
    return combos


def expected_local(g: torch.Tensor, mesh, placements, coordinate) -> torch.Tensor:
    """A rank's slab computed independently of physics_dp: tensor_split per Shard axis,
    then an exact decomposition for each Partial axis."""
    local = g
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            local = torch.tensor_split(local, mesh.size(axis), dim=placement.dim)[coordinate[axis]]
    for axis, placement in enumerate(placements):
        if isinstance(placement, Partial):
            local = partial_part(local, placement.reduce_op, coordinate[axis], mesh.size(axis))
    return local.contiguous()


def partial_part(value: torch.Tensor, op: str, c: int, n: int) -> torch.Tensor:
    """Piece ``c`` of ``n`` whose reduction by ``op`` is exactly ``value``."""
    if op == "sum":
        share = torch.div(value, n, rounding_mode="floor")
        return value - (n - 1) * share if c == 0 else share
    if op == "avg":
        return value + 2.0 * (c - (n - 1) / 2)
    if op == "max":
        return value - c
    return value + c
