"""Process-wide view of the distributed job: rank layout, device, process group, device meshes."""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import launch_env

BACKEND_ENV_VAR = "PHYSICS_DP_BACKEND"
# How long a collective waits for its peers before failing: minutes, not torch's 30-minute default,
# so a stalled rank or a collective called on some ranks only ends the job soon (parallel.timeout_s).
DEFAULT_TIMEOUT_S = 300.0


def resolve_mesh_shape(mesh_shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """Fill in a single ``-1`` entry so the mesh covers exactly ``world_size`` ranks."""
    shape = tuple(int(s) for s in mesh_shape)
    if not shape:
        raise ValueError("mesh_shape must have at least one entry")
    inferred = [i for i, s in enumerate(shape) if s == -1]
    if len(inferred) > 1:
        raise ValueError(f"mesh_shape {shape} has more than one -1 entry; at most one can be inferred")
    if any(s <= 0 and s != -1 for s in shape):
        raise ValueError(f"mesh_shape {shape} has a non-positive entry; entries must be >= 1 or a single -1")
    known = math.prod(s for s in shape if s != -1)
    if inferred:
        if world_size % known != 0:
            raise ValueError(
                f"mesh_shape {shape} cannot be completed: world size {world_size} is not divisible by {known}"
            )
        shape = tuple(world_size // known if s == -1 else s for s in shape)
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh_shape {shape} has {math.prod(shape)} ranks but the world size is {world_size}")
    return shape


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """Names matching the project's conventions: a 1-D mesh is the domain axis, 2-D is (data, domain)."""
    if ndim == 1:
        return ("domain",)
    if ndim == 2:
        return ("data", "domain")
    return tuple(f"axis{i}" for i in range(ndim))


def build_device_mesh(
    mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None = None
) -> DeviceMesh:
    """A DeviceMesh over all ranks of the default process group (collective: every rank calls it).

    One mesh per (shape, names) for the life of the process group. Building a mesh creates a process
    group per axis (gloo threads and sockets, a shared-memory channel), and nothing frees those before
    the default group goes, so a process that trains again (a sweep, a notebook, a test pool) reuses
    the mesh instead: rebuilt per run, a 2 x 2 mesh left 6 threads, 12 descriptors and 144 MiB of
    ``/dev/shm`` behind on every rank each time.
    """
    manager = DistributedManager()
    if not manager.is_initialized():
        raise RuntimeError("call DistributedManager.initialize() before building a device mesh")
    shape = resolve_mesh_shape(mesh_shape, manager.world_size)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else default_axis_names(len(shape))
    if len(names) != len(shape):
        raise ValueError(f"mesh_dim_names {names} has {len(names)} entries but mesh_shape {shape} has {len(shape)}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names {names} must be unique")
    world, mesh = manager._meshes.get((shape, names), (None, None))
    if mesh is not None and world is dist.group.WORLD:  # a re-created default group voids the old meshes
        return mesh
    mesh = init_device_mesh(manager.device.type, shape, mesh_dim_names=names)
    from .host_channel import open_channel  # host_channel imports this module

    for dim in range(mesh.ndim):  # now, while every rank is here: halo messages then use shared memory from the start
        open_channel(mesh.get_group(dim))
    manager._meshes[(shape, names)] = (dist.group.WORLD, mesh)
    return mesh


class DistributedManager:
    """Shared-state singleton: every ``DistributedManager()`` sees the same rank layout.

    Shared state (rather than a module global) lets models, data loaders and trainers ask
    ``DistributedManager().rank`` anywhere without threading a handle through every call.
    Before ``initialize()`` it describes a lone CPU process.
    """

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        self.__dict__ = self._shared_state
        if not self._shared_state:
            self._reset()

    def _reset(self) -> None:
        self._initialized = False
        self._rank = 0
        self._world_size = 1
        self._local_rank = 0
        self._device = torch.device("cpu")
        self._backend: str | None = None
        self._owns_process_group = False
        self._global_mesh: DeviceMesh | None = None
        self._meshes: dict[tuple[tuple[int, ...], tuple[str, ...]], tuple[Any, DeviceMesh]] = {}
        self._timeout_s = DEFAULT_TIMEOUT_S

    @classmethod
    def is_initialized(cls) -> bool:
        return bool(cls._shared_state.get("_initialized", False))

    @classmethod
    def initialize(cls, backend: str | None = None, timeout: timedelta | float | None = None) -> None:
        """Join the job described by the environment; a no-op when already initialized.

        Order: an existing default process group is adopted; else torchrun variables; else SLURM;
        else a lone process, which still gets a 1-rank process group (in-memory store, no port) so
        device meshes and collectives behave the same at every world size. ``timeout`` (seconds or a
        timedelta; default ``DEFAULT_TIMEOUT_S``) bounds how long any collective waits for its peers.
        """
        if cls.is_initialized():
            return
        manager = cls()
        if timeout is None:
            timeout = DEFAULT_TIMEOUT_S
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        manager._timeout_s = timeout.total_seconds()
        cuda = torch.cuda.is_available()
        if dist.is_initialized():
            manager._adopt_process_group(cuda)
        else:
            backend = backend or os.environ.get(BACKEND_ENV_VAR) or ("nccl" if cuda else "gloo")
            manager._create_process_group(launch_env.detect(os.environ), backend, timeout, cuda)
        if cuda:
            manager._device = torch.device("cuda", manager._local_rank)
            torch.cuda.set_device(manager._device)
        manager._initialized = True

    def _adopt_process_group(self, cuda: bool) -> None:
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        fallback_local = self._rank % torch.cuda.device_count() if cuda else 0
        self._local_rank = int(os.environ.get("LOCAL_RANK", fallback_local))
        self._backend = dist.get_backend()
        self._owns_process_group = False

    def _create_process_group(
        self, env: launch_env.LaunchEnv | None, backend: str, timeout: timedelta, cuda: bool
    ) -> None:
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
        if env is None:
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        else:
            # Export what SLURM implied so env:// and downstream tools see one consistent picture.
            for key, value in (
                ("RANK", env.rank),
                ("WORLD_SIZE", env.world_size),
                ("LOCAL_RANK", env.local_rank),
                ("MASTER_ADDR", env.master_addr),
                ("MASTER_PORT", env.master_port),
            ):
                os.environ.setdefault(key, str(value))
            dist.init_process_group(init_method="env://", rank=env.rank, world_size=env.world_size, **kwargs)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._local_rank = env.local_rank if env is not None else 0
        self._backend = dist.get_backend()
        self._owns_process_group = True

    def initialize_mesh(
        self, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None = None
    ) -> DeviceMesh:
        """Build the job's main mesh (collective) and remember it as ``global_mesh``."""
        self._global_mesh = build_device_mesh(mesh_shape, mesh_dim_names)
        return self._global_mesh

    def cleanup(self) -> None:
        """Tear down what ``initialize()`` set up so it can run again (tests, notebooks).

        A multi-rank job that initializes again should use a new MASTER_PORT: peers can still be
        connected to rank 0's old store while it is being torn down.
        """
        from .host_channel import close_channels  # host_channel imports this module

        close_channels()
        if self._owns_process_group and dist.is_initialized():
            _wait_for_peers()
            dist.destroy_process_group()
        self._shared_state.clear()
        self._reset()

    @property
    def timeout_s(self) -> float:
        """How long a collective waits for its peers (``initialize(timeout=)``)."""
        return self._timeout_s

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def distributed(self) -> bool:
        """True when more than one process takes part (a lone process has a 1-rank group but is not distributed)."""
        return self._world_size > 1

    @property
    def backend(self) -> str | None:
        return self._backend

    @property
    def global_mesh(self) -> DeviceMesh | None:
        """The mesh from the last ``initialize_mesh`` call, or None before one."""
        return self._global_mesh

    def __repr__(self) -> str:
        return (
            f"DistributedManager(initialized={self._initialized}, rank={self._rank}, "
            f"world_size={self._world_size}, local_rank={self._local_rank}, device={self._device}, "
            f"backend={self._backend})"
        )


def _wait_for_peers(timeout_s: float = 10.0) -> None:
    """Before tearing gloo down, let every peer reach the same point (bounded: a peer may be gone).

    Destroying a gloo process group while a peer still drains its last collective or p2p message
    from this rank intermittently aborts one or both processes at exit ("terminate called without
    an active exception"), after all work succeeded.
    """
    if dist.get_backend() != "gloo" or dist.get_world_size() == 1:
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError:
        pass  # a peer failed or left: tearing down is all that is left to do
