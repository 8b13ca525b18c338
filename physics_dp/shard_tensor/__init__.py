"""ShardTensor: a rank's slab of a globally shaped tensor, with uneven splits and exact gradients."""

from .placements import Partial, Placement, Replicate, Shard
from .shard_tensor import ShardTensor
from .spec import ShardTensorSpec, balanced_sizes
from .conversions import distribute_tensor, redistribute_to_spec, replicate_plain
from .fallback import ShardingRuleError
from .scatter import scatter_tensor

__all__ = [
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "ShardTensor",
    "ShardTensorSpec",
    "ShardingRuleError",
    "balanced_sizes",
    "distribute_tensor",
    "redistribute_to_spec",
    "replicate_plain",
    "scatter_tensor",
]
