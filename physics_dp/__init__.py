"""physics_dp: domain-parallel PyTorch for physics and weather models."""

from .distributed import DistributedManager
from .shard_tensor import Partial, Replicate, Shard, ShardTensor, ShardTensorSpec, scatter_tensor
from . import ops  # noqa: E402,F401  (registers the sharded op handlers)

__version__ = "0.1.0"

__all__ = [
    "DistributedManager",
    "Partial",
    "Replicate",
    "Shard",
    "ShardTensor",
    "ShardTensorSpec",
    "scatter_tensor",
]
