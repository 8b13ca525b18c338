"""Process groups, device meshes and collectives for domain parallelism."""

from .manager import DistributedManager, build_device_mesh, default_axis_names, resolve_mesh_shape

__all__ = ["DistributedManager", "build_device_mesh", "default_axis_names", "resolve_mesh_shape"]
