"""Apply data parallelism (FSDP2, DDP or none) on top of domain parallelism, as the trainer does.

The mesh has a ``"data"`` axis and one or more domain axes (every other axis).  Activations are
ShardTensors on the domain sub-mesh only, so physics_dp's ops sum parameter gradients over the
domain axes and the data-parallel wrapper averages them over ``"data"``: each contribution is
counted exactly once.  The model is wrapped in :class:`FSDPOutputTensorAdapter` so FSDP's and
DDP's output hooks only ever see plain tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from .fsdp_adapter import FSDPOutputTensorAdapter
from .module_sync import sync_module_over_mesh

__all__ = [
    "ParallelModel", "parallelize", "domain_mesh", "data_size", "default_fsdp_units", "DATA_AXIS", "DEFAULT_FSDP_UNIT_PARAMS",
]

DATA_AXIS = "data"
DataParallel = Literal["fsdp", "ddp", "none"]
_PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def _axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise ValueError("parallelize needs a mesh with named axes, e.g. ('data', 'domain')")
    return names


def data_size(mesh: DeviceMesh) -> int:
    """Number of data-parallel replicas (1 when the mesh has no ``"data"`` axis)."""
    names = _axis_names(mesh)
    return mesh.size(names.index(DATA_AXIS)) if DATA_AXIS in names else 1


def domain_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh of every axis except ``"data"``: where activations are ShardTensors."""
    names = tuple(n for n in _axis_names(mesh) if n != DATA_AXIS)
    if not names:
        raise ValueError(f"mesh {mesh} has no domain axis; add one of size 1, e.g. ('data', 'domain') = (N, 1)")
    return mesh if len(names) == mesh.ndim else mesh[names]


# A block is its own FSDP unit from this many parameters (64 MiB in fp32) on.  Each unit costs two or
# three collectives per step (gathers in forward and backward, a reduce-scatter); below this size
# their latency costs more than gathering the block with the model's root unit saves in memory.
DEFAULT_FSDP_UNIT_PARAMS = 1 << 24


def default_fsdp_units(model: nn.Module, min_params: int = DEFAULT_FSDP_UNIT_PARAMS) -> list[nn.Module]:
    """Blocks to shard one by one (each gathers its parameters only while it runs): the items of
    every ``nn.ModuleList``/``nn.Sequential`` that hold at least ``min_params`` parameters,
    outermost first.  Smaller blocks stay in the model's root unit, gathered once per forward.

    Why the floor: on 4 CPU ranks (2 data x 2 domain) the quick start's step took 370-430 ms with
    each of its 12 blocks (288-8096 parameters) a unit, 210-243 ms with the root alone.
    """
    units: list[nn.Module] = []
    claimed: set[int] = set()
    for module in model.modules():
        if id(module) in claimed:
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and module is not model:
            for child in module:
                size = sum(p.numel() for p in child.parameters())
                if size and size >= min_params:
                    units.append(child)
                    claimed.update(id(m) for m in child.modules())
    return units


class ParallelModel(nn.Module):
    """The model as the trainer calls it: ShardTensors in, ShardTensors out.

    ``.model`` is the user's module (its parameters are DTensors sharded over ``"data"`` under
    FSDP over several data replicas, plain tensors otherwise): save checkpoints and build
    optimizers from it.
    """

    def __init__(self, adapter: FSDPOutputTensorAdapter, runner: nn.Module, autocast_dtype: torch.dtype | None, device_type: str):
        super().__init__()
        self.runner = runner
        # Reached through runner; set around nn.Module's registration so state_dict holds one copy.
        object.__setattr__(self, "_adapter", adapter)
        self._autocast_dtype = autocast_dtype
        self._device_type = device_type

    @property
    def model(self) -> nn.Module:
        return self._adapter.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._autocast_dtype is None:
            return self._adapter.restore(self.runner(*args, **kwargs))
        with torch.autocast(self._device_type, dtype=self._autocast_dtype):
            return self._adapter.restore(self.runner(*args, **kwargs))

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """A context whose forward and backward passes reduce gradients over the data replicas only
        if ``enabled``.  Disabled (every micro-batch of an accumulated step but the last), FSDP's
        reduce-scatters and DDP's all-reduces are skipped and the gradients accumulate on each
        replica, unsharded under FSDP, until a backward with sync reduces their sum once."""
        runner = self.runner
        if enabled or not isinstance(runner, (FSDPModule, DistributedDataParallel)):
            yield
        elif isinstance(runner, DistributedDataParallel):
            with runner.no_sync():
                yield
        else:
            runner.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                runner.set_requires_gradient_sync(True)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    data_parallel: DataParallel = "fsdp",
    mixed_precision: str = "fp32",
    *,
    fsdp_units: Callable[[nn.Module], Iterable[nn.Module]] | None = default_fsdp_units,
    reduce_in_fp32: bool = True,
) -> ParallelModel:
    """Sync ``model`` over ``mesh`` and wrap it for data parallelism over the ``"data"`` axis.

    ``data_parallel``: ``"fsdp"`` (``fully_shard`` each unit from ``fsdp_units`` and the whole
    model over ``mesh["data"]``), ``"ddp"`` (``DistributedDataParallel`` over the data process
    group) or ``"none"`` (needs a data axis of size 1).  With one data replica (a data axis of size 1,
    or none) FSDP and DDP have nothing to shard or average, and the model runs as under ``"none"``:
    on CPU ranks FSDP2's per-unit gathers and reduce-scatters over one rank cost a StormCast lite
    step 18%.  ``mixed_precision``: ``"fp32"`` or
    ``"bf16"`` (bf16 compute; under FSDP parameters are gathered in bf16 and gradients reduced
    in fp32 when ``reduce_in_fp32``, elsewhere autocast with fp32 parameters and gradients).
    Gradients are averaged over data replicas, so a loss that is each replica's mean gives the
    global-batch mean when replicas hold equal batches.
    """
    if data_parallel not in ("fsdp", "ddp", "none"):
        raise ValueError(f"data_parallel must be 'fsdp', 'ddp' or 'none', got {data_parallel!r}")
    if mixed_precision not in _PRECISIONS:
        raise ValueError(f"mixed_precision must be one of {sorted(_PRECISIONS)}, got {mixed_precision!r}")
    domain_mesh(mesh)  # validates the axes early
    replicas = data_size(mesh)
    if data_parallel == "none" and replicas > 1:
        raise ValueError(
            f"data_parallel='none' with {replicas} data replicas would train diverging copies; "
            "use 'fsdp' or 'ddp', or a data axis of size 1"
        )
    if replicas == 1:
        data_parallel = "none"
    low_precision = _PRECISIONS[mixed_precision]
    sync_module_over_mesh(model, mesh)
    adapter = FSDPOutputTensorAdapter(model, immediate_grad_sums=data_parallel != "none")
    autocast_dtype = low_precision
    if data_parallel == "fsdp":
        data_mesh = mesh[DATA_AXIS]
        policy = MixedPrecisionPolicy(
            param_dtype=low_precision, reduce_dtype=torch.float32 if (low_precision and reduce_in_fp32) else None
        )
        for unit in (fsdp_units(model) if fsdp_units is not None else ()):
            fully_shard(unit, mesh=data_mesh, mp_policy=policy)
        fully_shard(adapter, mesh=data_mesh, mp_policy=policy)
        runner: nn.Module = adapter
        autocast_dtype = None  # FSDP casts parameters and inputs itself
    elif data_parallel == "ddp":
        runner = DistributedDataParallel(adapter, process_group=mesh.get_group(DATA_AXIS))
    else:
        runner = adapter
    return ParallelModel(adapter, runner, autocast_dtype, mesh.device_type)
