"""Module-level parallelism: replicas synced over the mesh, gradients reduced once, FSDP2/DDP on top."""

from .compile import compile_in_place
from .losses import masked_mean, replicated_value
from .fsdp_adapter import FSDPOutputTensorAdapter, distribute_over_domain_for_fsdp, wrap_for_fsdp
from .module_sync import all_reduce_gradients, distribute_module, sync_module_over_mesh
from .parallelize import ParallelModel, data_size, default_fsdp_units, domain_mesh, parallelize

__all__ = [
    "FSDPOutputTensorAdapter",
    "ParallelModel",
    "all_reduce_gradients",
    "compile_in_place",
    "data_size",
    "default_fsdp_units",
    "distribute_module",
    "distribute_over_domain_for_fsdp",
    "domain_mesh",
    "masked_mean",
    "parallelize",
    "replicated_value",
    "sync_module_over_mesh",
    "wrap_for_fsdp",
]
