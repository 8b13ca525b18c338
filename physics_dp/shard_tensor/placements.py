"""Helpers over PyTorch's placement types (``Shard``, ``Replicate``, ``Partial``).

physics_dp uses PyTorch's own placement classes so that specs move to and from DTensor
without translation; this module only adds the checks and small queries we need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Placement", "Shard", "Replicate", "Partial", "StridedShard", "normalize_placements", "partial_op", "SHARDING_PLACEMENTS"]


@dataclass(frozen=True)
class StridedShard:
    """A mesh axis sharding one factor of a tensor dim that is a row-major flatten of several.

    ``flatten(2)`` of (N, D, H, W) sharded over H on one mesh axis and W on another gives
    tokens (N, D, H*W) whose slab on each rank is the flatten of its own H x W block: no
    contiguous range of the token dim, so ``Shard`` cannot describe it.  Every axis sharding
    such a dim carries one ``StridedShard(dim, factors, factor)``: the dim's logical extents
    ``factors`` (row-major) and which of them this axis splits.  The slab along ``dim`` is the
    row-major flatten of each factor's local extent (the whole factor where no axis splits it).

    It is deliberately not a ``Shard``: code that only knows ``Shard`` must not mistake it for
    one; dispatch hands such tensors only to handlers that know it (``ops/strided.py``) and
    converts them to a contiguous layout for every other op.
    """

    dim: int
    factors: tuple[int, ...]
    factor: int

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def __repr__(self) -> str:
        return f"StridedShard(dim={self.dim}, factors={self.factors}, factor={self.factor})"


# the placement types that split a tensor dim over a mesh axis (``type(p) in SHARDING_PLACEMENTS``)
SHARDING_PLACEMENTS = (Shard, StridedShard)

_PARTIAL_OPS = ("sum", "avg", "max", "min", "product")


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
        elif type(placement) is StridedShard:
            out.append(_normalized_strided(placement, ndim))
        else:
            raise ValueError(
                f"unsupported placement {placement!r}; physics_dp supports Shard(dim), Replicate() and "
                "Partial(sum|avg|max|min)"
            )
    _check_strided_consistent(out)
    return tuple(out)


def _normalized_strided(placement: StridedShard, ndim: int) -> StridedShard:
    if not -ndim <= placement.dim < max(ndim, 1):
        raise ValueError(f"{placement} is out of range for a {ndim}-D tensor")
    if not 0 <= placement.factor < len(placement.factors) or min(placement.factors, default=0) < 1:
        raise ValueError(f"{placement}: factor must index factors, and factors must be positive extents")
    return StridedShard(placement.dim % max(ndim, 1), tuple(int(f) for f in placement.factors), placement.factor)


def _check_strided_consistent(placements: Sequence[Placement]) -> None:
    """Axes on one strided dim agree on its factors and split different factors; no ``Shard`` of it."""
    by_dim: dict[int, list[StridedShard]] = {}
    for placement in placements:
        if type(placement) is StridedShard:
            by_dim.setdefault(placement.dim, []).append(placement)
    shard_dims = {p.dim for p in placements if type(p) is Shard}
    for dim, group in by_dim.items():
        if dim in shard_dims or len({p.factors for p in group}) > 1 or len({p.factor for p in group}) < len(group):
            raise ValueError(
                f"placements {tuple(placements)} describe dim {dim} inconsistently: the StridedShard axes of one "
                "dim must share its factors, split different factors, and no Shard may split the same dim"
            )

