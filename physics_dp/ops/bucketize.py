"""``searchsorted`` / ``bucketize`` of sharded values against replicated 1-D boundaries, on the slab.

Each value's bucket depends on that value and the boundaries alone, so with the boundaries on
every rank each rank searches its own slab and the result keeps the values' split: nothing is
sent.  DTensor has no rule for either op, so without this they raised.  Boundaries that are
themselves sharded, or batched (more than one dim), take the fallback and its error.
"""

from __future__ import annotations

from typing import Any

import torch

from ..shard_tensor import ShardTensor
from ..shard_tensor.fallback import propagate_and_run
from ..shard_tensor.redistribute import without_partials
from ._local import contiguous_result, slab_as
from .indexing import replicated_plain

__all__: list[str] = []

aten = torch.ops.aten


def _whole(tensor: Any) -> torch.Tensor | None:
    """A 1-D tensor every rank holds whole (plain, or replicated on every mesh axis), as a plain tensor."""
    plain = replicated_plain(tensor)
    return plain if plain is not None and plain.ndim == 1 else None


def _search_slab(op: torch._ops.OpOverload, args: tuple, kwargs: dict, values_at: int, boundaries_at: int) -> Any:
    values, boundaries = args[values_at], _whole(args[boundaries_at])
    sorter = kwargs.get("sorter")
    if not isinstance(values, ShardTensor) or boundaries is None or (sorter is not None and _whole(sorter) is None):
        return propagate_and_run(op, args, kwargs)
    spec = without_partials(values._spec)
    local_args = list(args)
    local_args[values_at], local_args[boundaries_at] = slab_as(values, spec), boundaries
    if sorter is not None:
        kwargs = {**kwargs, "sorter": _whole(sorter)}
    return contiguous_result(op(*local_args, **kwargs), spec)


def _searchsorted(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    return _search_slab(op, args, kwargs, values_at=1, boundaries_at=0)


def _bucketize(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    return _search_slab(op, args, kwargs, values_at=0, boundaries_at=1)


ShardTensor.register_dispatch_handler(aten.searchsorted.Tensor, _searchsorted)
ShardTensor.register_dispatch_handler(aten.bucketize.Tensor, _bucketize)
