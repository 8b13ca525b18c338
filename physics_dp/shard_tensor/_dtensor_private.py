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
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

__all__ = ["DTensorSpec", "OutputSharding", "TESTED_TORCH", "make_spec", "propagate"]

TESTED_TORCH = ("2.13",)

if ".".join(torch.__version__.split(".")[:2]) not in TESTED_TORCH:
    warnings.warn(
        f"physics_dp's DTensor fallback was validated on torch {TESTED_TORCH}; found {torch.__version__}. "
        "Run tests/shard_tensor/test_dtensor_private.py before relying on the fallback.",
        stacklevel=2,
    )


def make_spec(mesh: DeviceMesh, placements: tuple, shape: torch.Size, stride: tuple, dtype: torch.dtype) -> DTensorSpec:
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype))


def propagate(op: torch._ops.OpOverload, args_schema: tuple, kwargs_schema: dict[str, Any]) -> OutputSharding:
    """DTensor's sharding decision for ``op`` on inputs described by ``args_schema``.

    Raises ``NotImplementedError`` when DTensor has no rule for the op.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    schema_info = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=schema_info)
    return propagator.propagate_op_sharding(schema)
