"""physics_dp: domain-parallel PyTorch for physics and weather models."""

from .distributed import DistributedManager
from .shard_tensor import Partial, Replicate, Shard, ShardTensor, ShardTensorSpec, scatter_tensor

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
