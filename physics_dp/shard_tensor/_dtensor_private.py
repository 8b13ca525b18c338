"""The one place physics_dp touches private DTensor internals: its sharding propagator.

DTensor knows sharding rules for hundreds of aten ops, but its public dispatch runs them on
the ``torch.chunk`` layout and silently mislabels uneven splits.  We only ask its propagator
*which placements* an op needs and produces, then move data and size outputs ourselves.
These names are private and move between releases; ``tests/shard_tensor/test_dtensor_private.py``
pins the behaviour we rely on.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding, RuntimeSchemaInfo
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Placement, _MaskPartial

__all__ = ["DTensorSpec", "OutputSharding", "TESTED_TORCH", "make_spec", "mask_partial", "norm_partial", "propagate"]

TESTED_TORCH = ("2.13",)

if ".".join(torch.__version__.split(".")[:2]) not in TESTED_TORCH:
    warnings.warn(
        f"physics_dp's DTensor fallback was validated on torch {TESTED_TORCH}; found {torch.__version__}. "
        "Run tests/shard_tensor/test_dtensor_private.py before relying on the fallback.",
        stacklevel=2,
    )


def make_spec(mesh: DeviceMesh, placements: tuple, shape: torch.Size, stride: tuple, dtype: torch.dtype) -> DTensorSpec:
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype))


_HASHED_SCHEMA_INFO: dict[torch._ops.OpOverload, RuntimeSchemaInfo] = {}


def _schema_info_hashing_every_argument(op: torch._ops.OpOverload, kwargs_schema: dict[str, Any]) -> RuntimeSchemaInfo:
    """DTensor's schema info for ``op`` with every non-tensor argument in the cache key.

    The propagator caches decisions keyed on the arguments from the registered ``static_argnum``
    on (100 when an op registers none) and on the named kwargs only.  In torch 2.13 several ops
    register too late an index: after ``topk(x, 3, d)``, ``topk(x, 2, d)`` got the first call's
    output shape, as did ``histc`` with another ``bins``; an argument that decides placements
    but not shapes would go unnoticed.  Hashing from the first non-tensor argument, and every
    kwarg, costs only cache misses for calls that differ.
    """
    info = _HASHED_SCHEMA_INFO.get(op)
    if info is None:
        propagator = DTensor._op_dispatcher.sharding_propagator
        registered = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
        first = next((i for i, a in enumerate(op._schema.arguments) if "Tensor" not in str(a.type)), len(op._schema.arguments))
        info = _HASHED_SCHEMA_INFO[op] = RuntimeSchemaInfo(first, None, registered.needs_pytree if registered else False)
    if kwargs_schema:
        return RuntimeSchemaInfo(info.static_argnum, sorted(kwargs_schema), info.needs_pytree)
    return info


def propagate(op: torch._ops.OpOverload, args_schema: tuple, kwargs_schema: dict[str, Any]) -> OutputSharding:
    """DTensor's sharding decision for ``op`` on inputs described by ``args_schema``.

    Raises ``NotImplementedError`` when DTensor has no rule for the op.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=_schema_info_hashing_every_argument(op, kwargs_schema))
    return propagator.propagate_op_sharding(schema)


def mask_partial(placement: Placement) -> tuple[int, torch.Size] | None:
    """``(offset_dim, offset_shape)`` of a ``_MaskPartial`` (else None): DTensor's placement for an
    index into a tensor of ``offset_shape`` sharded on ``offset_dim`` (gather, embedding), each rank
    looking up only the rows it holds and summing the looked-up values over the mesh axis."""
    if not isinstance(placement, _MaskPartial) or placement.reduce_op != "sum" or placement.offset_shape is None:
        return None
    return placement.offset_dim, torch.Size(placement.offset_shape)


def norm_partial(placement: Placement) -> float | None:
    """``p`` of a ``_NormPartial`` (else None): each rank holds the p-norm of its part, and the
    value is the p-norm of those norms (DTensor uses it for p not in {0, inf, -inf})."""
    return float(placement.norm_type) if isinstance(placement, _NormPartial) else None
