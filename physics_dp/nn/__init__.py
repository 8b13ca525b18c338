"""Module-level parallelism: replicas synced over the mesh, gradients reduced once."""

from .module_sync import all_reduce_gradients, distribute_module, sync_module_over_mesh

__all__ = ["all_reduce_gradients", "distribute_module", "sync_module_over_mesh"]
