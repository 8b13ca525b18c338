"""Layouts that need no communication run the plain op on the slab.

When every mesh axis of more than one rank replicates a tensor (in particular every tensor on a
one-rank mesh, e.g. a job with one domain rank), each rank's slab *is* the global value: halos
are empty, statistics are local, parameter gradients need no sum.  Such ops skip the sharded
machinery (halo planning, statistics merges, DTensor sharding propagation) and cost what torch
costs, plus the wrapper.  Outputs keep the input's mesh and placements (a ``Shard`` of a dim the
output no longer has becomes ``Replicate``), with the local result's own strides.
"""

from __future__ import annotations

from typing import Any

import torch

from .placements import Placement, Replicate, Shard
from .spec import ShardTensorSpec

__all__ = ["RETURNS_VIEWS", "local_only_spec", "output_placements", "run_function_on_slabs", "run_aten_on_slabs"]

# Handled functions whose torch result is a view of an input.  Running them on the slabs through
# to_local/from_local would hide that aliasing from autograd (an in-place update of the result
# would change the input unseen), so on local-only layouts they take torch's own path, whose
# aten view ops reach run_aten_on_slabs below autograd, which tracks views.
RETURNS_VIEWS = frozenset({torch.Tensor.__getitem__, torch.select, torch.Tensor.select})

_ShardTensor: type | None = None


def bind_shard_tensor_class(cls: type) -> None:
    global _ShardTensor
    _ShardTensor = cls


def local_only_spec(args: tuple, kwargs: dict) -> ShardTensorSpec | None:
    """When no ShardTensor argument needs communication, the spec whose placements outputs take.

    That is the first sharded argument's (``c * x`` with a replicated ``c`` stays sharded like
    ``x``), else the first argument's.
    """
    cls = _ShardTensor
    first = sharded = None
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, cls):
                spec = item._spec
                if not spec.local_only or (first is not None and spec.mesh is not first.mesh):
                    return None
                first = first or spec
                if sharded is None and any(sizes is not None for sizes in spec.axis_sizes):
                    sharded = spec
    return sharded or first


def output_placements(like: ShardTensorSpec, ndim: int) -> list[Placement]:
    """The placements of an ``ndim``-D output of a local-only op on inputs laid out like ``like``."""
    return [Replicate() if type(p) is Shard and p.dim >= ndim else p for p in like.placements]


def _output_spec(like: ShardTensorSpec, local: torch.Tensor) -> ShardTensorSpec:
    return ShardTensorSpec(like.mesh, output_placements(like, local.ndim), local.shape, stride=local.stride())


def _map(value: Any, fn: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(fn(v) for v in value)
    return fn(value)


def run_function_on_slabs(func: Any, args: tuple, kwargs: dict, like: ShardTensorSpec) -> Any:
    """``func`` on the slabs, differentiably: gradients flow through ``to_local`` and back."""
    from .conversions import from_local_exact, to_local
    from .dtensor_params import is_dtensor_param, local_replica

    cls = _ShardTensor

    def unwrap(value: Any) -> Any:
        if isinstance(value, cls):
            return to_local(value)
        return local_replica(value) if is_dtensor_param(value) else value

    result = func(*(_map(a, unwrap) for a in args), **{k: _map(v, unwrap) for k, v in kwargs.items()})

    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, cls):
            return from_local_exact(value, _output_spec(like, value))
        return value

    return _map(result, wrap)


def run_aten_on_slabs(op: torch._ops.OpOverload, args: tuple, kwargs: dict, like: ShardTensorSpec) -> Any:
    """An aten op below autograd on the slabs; a result that is an input's slab (in-place, out=) returns that input."""
    cls = _ShardTensor
    owners: dict[int, Any] = {}

    def unwrap(value: Any) -> Any:
        if isinstance(value, cls):
            owners[id(value._local_tensor)] = value
            return value._local_tensor
        return value

    result = op(*(_map(a, unwrap) for a in args), **{k: _map(v, unwrap) for k, v in kwargs.items()})

    def wrap(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        owner = owners.get(id(value))
        return owner if owner is not None else cls(value, _output_spec(like, value))

    return _map(result, wrap)
