"""The output split of an op that resizes a sharded dim, found by every rank alone.

The fallback (:mod:`.fallback`) carries an output's split from an input dim of the same extent.
An op that resizes a sharded dim (``pixel_shuffle``) has no such input; its split would need
every rank's slab extent, an all-gather, which also cannot run inside ``torch.compile``.  But
every rank knows every slab's input shape from the specs, so it can run the op on meta tensors
shaped as each coordinate's slabs and read the extents off: no meeting, nothing read from the
data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ..distributed.tracing import is_tracing, outside_trace
from .shard_tensor import ShardTensor
from .spec import ShardTensorSpec, mesh_coordinate

__all__ = ["SlabShapes"]

_EXTENTS_CACHE_SIZE = 1024
_extents_cache: dict[tuple, tuple[int, ...] | None] = {}


class SlabShapes:
    """One fallback call's output slab shapes at every coordinate, from meta runs of the op (lazily,
    once per coordinate; None where it cannot run: no meta kernel, data-dependent sizes).

    Not for ops whose arguments DTensor rewrote into this rank's local shapes (another coordinate
    would need other arguments).  A meta run costs 0.1-0.2 ms on the CPU, so eager calls remember
    the extents by the call's signature (op, specs, dtypes, other arguments): a training loop
    repeats its calls.
    """

    def __init__(
        self, op: Any, flat_args: list, args_tree: Any, specs: list[ShardTensorSpec], kwargs: dict, usable: bool
    ) -> None:
        self.op, self.flat_args, self.args_tree, self.specs, self.kwargs = op, flat_args, args_tree, specs, kwargs
        self.usable = usable
        self.results: dict[tuple[int, ...], Any] = {}

    def extents(self, axis: int, path: tuple[int, ...], dim: int) -> tuple[int, ...] | None:
        """The output at ``path``'s extent along ``dim`` at each coordinate of mesh axis ``axis``."""
        if not self.usable:
            return None
        key = self._signature(axis, path, dim)
        if key is not None and key in _extents_cache:
            return _extents_cache[key]
        mesh = self.specs[0].mesh
        here = list(mesh_coordinate(mesh))
        extents: list[int] = []
        for position in range(mesh.size(axis)):
            here[axis] = position
            result = self._result_at(tuple(here))
            for index in path:
                result = result[index] if isinstance(result, (list, tuple)) else None
            if not isinstance(result, torch.Tensor):
                extents = []
                break
            extents.append(result.shape[dim])
        found = tuple(extents) or None
        if key is not None:
            if len(_extents_cache) >= _EXTENTS_CACHE_SIZE:
                _extents_cache.clear()
            _extents_cache[key] = found
        return found

    def _signature(self, axis: int, path: tuple[int, ...], dim: int) -> tuple | None:
        """What the extents depend on, hashable; None inside a trace (sizes there may be symbolic) or
        for an argument that cannot be hashed."""
        if is_tracing():
            return None

        def described(value: Any) -> Any:
            if isinstance(value, ShardTensor):
                return value._spec, value.dtype
            return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value

        key = (
            self.op, self.args_tree, tuple(self.specs), tuple(described(v) for v in self.flat_args),
            tuple(sorted((k, described(v)) for k, v in self.kwargs.items())), mesh_coordinate(self.specs[0].mesh),
            axis, path, dim,
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _result_at(self, coordinate: tuple[int, ...]) -> Any:
        if coordinate not in self.results:
            self.results[coordinate] = self._run_on_meta(coordinate)
        return self.results[coordinate]

    def _run_on_meta(self, coordinate: tuple[int, ...]) -> Any:
        """The op on meta slabs: positional tensors as redistributed (their target specs), keyword
        tensors as given (the op takes their slabs unchanged)."""
        specs = iter(self.specs)

        def meta(value: Any, spec: ShardTensorSpec | None) -> Any:
            shape = value.shape if spec is None else spec.local_shape(coordinate)
            return torch.empty(shape, dtype=value.dtype, device="meta")

        def keyword(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            return meta(value, value._spec if isinstance(value, ShardTensor) else None)

        try:
            with outside_trace():  # plain meta tensors, even inside a trace
                leaves = [meta(v, next(specs)) if isinstance(v, torch.Tensor) else v for v in self.flat_args]
                kwargs = {k: keyword(v) for k, v in self.kwargs.items()}
                return self.op(*pytree.tree_unflatten(leaves, self.args_tree), **kwargs)
        except Exception:  # no meta kernel, or sizes that depend on the data: the caller gathers them
            return None
