"""Helpers over PyTorch's placement types (``Shard``, ``Replicate``, ``Partial``).

physics_dp uses PyTorch's own placement classes so that specs move to and from DTensor
without translation; this module only adds the checks and small queries we need.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Placement", "Shard", "Replicate", "Partial", "normalize_placements", "partial_op"]

_PARTIAL_OPS = ("sum", "avg", "max", "min")


def partial_op(placement: Placement) -> str:
    """The pending reduction of a ``Partial`` placement, validated."""
    op = placement.reduce_op  # type: ignore[attr-defined]
    if op not in _PARTIAL_OPS:
        raise ValueError(f"Partial({op!r}) is not supported; use one of {_PARTIAL_OPS}")
    return op


def normalize_placements(placements: Sequence[Placement], ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    """Validate placements against a tensor rank and mesh rank; negative shard dims become positive."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"got {len(placements)} placements {placements} for a {mesh_ndim}-D device mesh; "
            "give exactly one placement per mesh axis"
        )
    out: list[Placement] = []
    sharded_dims: set[int] = set()
    for placement in placements:
        if type(placement) is Shard:
            dim = placement.dim
            if not -ndim <= dim < max(ndim, 1):
                raise ValueError(f"Shard({dim}) is out of range for a {ndim}-D tensor")
            dim %= max(ndim, 1)
            if dim in sharded_dims:
                raise ValueError(
                    f"placements {placements} shard tensor dim {dim} over two mesh axes; "
                    "nested sharding of one dim is not supported: shard different dims or flatten the mesh"
                )
            sharded_dims.add(dim)
            out.append(Shard(dim))
        elif type(placement) is Replicate:
            out.append(placement)
        elif type(placement) is Partial:
            partial_op(placement)
            out.append(placement)
        else:
            raise ValueError(
                f"unsupported placement {placement!r}; physics_dp supports Shard(dim), Replicate() and "
                "Partial(sum|avg|max|min)"
            )
    return tuple(out)
