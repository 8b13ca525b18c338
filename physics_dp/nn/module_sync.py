"""Make a module's replicas agree across a device mesh, and reduce their gradients.

Domain parallelism keeps parameters as plain tensors replicated on every rank; the sharded ops
sum parameter gradients over the axes that split the data (``ops._local.local_param``).  That
only equals one device if every replica starts from the same values, hence
:func:`sync_module_over_mesh`.  Data parallelism without FSDP then needs the gradients summed
over the data axis, which :func:`all_reduce_gradients` does with one collective per dtype
bucket rather than one per parameter.

Every byte goes through :mod:`physics_dp.distributed.collectives`, so tests can count it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import collectives
from ..ops._local import groups_spanning

__all__ = ["sync_module_over_mesh", "distribute_module", "all_reduce_gradients", "resolve_axes"]

Axis = int | str
PartitionFn = Callable[[str, nn.Module, DeviceMesh], None]


def resolve_axes(mesh: DeviceMesh, axes: Axis | Sequence[Axis] | None) -> tuple[int, ...]:
    """Mesh axes as sorted, unique ints; ``None`` means every axis; names resolve via the mesh."""
    if axes is None:
        return tuple(range(mesh.ndim))
    items = [axes] if isinstance(axes, (int, str)) else list(axes)
    names = tuple(mesh.mesh_dim_names or ())
    resolved: set[int] = set()
    for item in items:
        if isinstance(item, str):
            if item not in names:
                raise ValueError(f"mesh has no axis named {item!r}; its axes are {names}")
            resolved.add(names.index(item))
        elif isinstance(item, int) and not isinstance(item, bool):
            if not -mesh.ndim <= item < mesh.ndim:
                raise ValueError(f"mesh axis {item} out of range for a {mesh.ndim}-D mesh")
            resolved.add(item % mesh.ndim)
        else:
            raise TypeError(f"a mesh axis must be an int or a name, got {item!r}")
    return tuple(sorted(resolved))


def _check_plain(name: str, tensor: torch.Tensor, what: str) -> None:
    """Subclasses (DTensor, ShardTensor) hold per-rank slabs: broadcasting them would be wrong."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_sparse:
        raise TypeError(
            f"{what} {name!r} is a {type(tensor).__name__}{' (sparse)' if tensor.is_sparse else ''}; "
            "physics_dp.nn expects plain dense tensors (parameters stay replicated plain tensors)"
        )


def _wire_view(flat: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` in a dtype every backend moves (gloo has no bool; complex as real pairs)."""
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.is_complex():
        return torch.view_as_real(flat)
    return flat


def _buckets(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """Tensors grouped by dtype (insertion order, identical on every rank for identical modules)."""
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    return buckets


def _signature(named: Sequence[tuple[str, torch.Tensor]]) -> list[int]:
    """A short fixed-length fingerprint of names, shapes and dtypes: equal lengths on every rank,
    so comparing it cannot itself hang, while unequal modules are caught before a bucket does."""
    text = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in named)
    return [len(named), sum(t.numel() for _, t in named), zlib.crc32(text.encode())]


def _check_same_layout(named: Sequence[tuple[str, torch.Tensor]], group, what: str) -> None:
    """Raise on every rank of ``group`` (never hang) if the ranks' tensor layouts differ."""
    mine = _signature(named)
    seen = collectives.gather_sizes(mine, group)
    if any(other != seen[0] for other in seen):
        raise RuntimeError(
            f"{what}: ranks of the group disagree on the module's tensors "
            f"(count, numel, layout checksum per group rank: {seen}; this rank: {mine}); "
            "every rank must build the same module"
        )


def sync_module_over_mesh(
    module: nn.Module, mesh: DeviceMesh, axis: Axis | Sequence[Axis] | None = None
) -> nn.Module:
    """Copy every parameter and buffer of ``module`` from the first rank of each group of ``axis``.

    Domain ranks must start identical: each computes a share of the same parameter gradient.
    ``axis=None`` syncs over every mesh axis, so all ranks end equal to mesh coordinate 0.
    Tensors are flattened into one buffer per dtype (one broadcast per dtype and axis, since
    every collective pays a latency floor); a cheap layout check first makes mismatched modules
    raise on every rank instead of hanging. Parameters must be plain tensors. Returns ``module``.
    """
    named: list[tuple[str, torch.Tensor]] = []
    for name, param in module.named_parameters():
        _check_plain(name, param, "parameter")
        named.append((name, param))
    for name, buffer in module.named_buffers():
        _check_plain(name, buffer, "buffer")
        named.append((name, buffer))
    for mesh_axis in resolve_axes(mesh, axis):
        group = mesh.get_group(mesh_axis)
        if dist.get_world_size(group) == 1:
            continue
        _check_same_layout(named, group, f"sync_module_over_mesh over mesh axis {mesh_axis}")
        with torch.no_grad():
            for tensors in _buckets(t for _, t in named).values():
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                collectives.broadcast(_wire_view(flat), 0, group)
                for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                    tensor.copy_(piece.view(tensor.shape))
    return module


def distribute_module(
    module: nn.Module, device_mesh: DeviceMesh, partition_fn: PartitionFn | None = None
) -> nn.Module:
    """Prepare ``module`` for domain parallelism on ``device_mesh`` (PhysicsNeMo-like semantics).

    Syncs every parameter and buffer over the whole mesh (so replicas start identical), then
    calls ``partition_fn(name, submodule, device_mesh)`` for every submodule, root included
    (name ``""``), as ``torch.distributed.tensor.distribute_module`` does. Unlike that function,
    parameters stay plain tensors: physics_dp's ops sum their gradients over the sharded axes
    themselves, so no DTensor parameters (and no implicit collectives in the optimizer) arise.
    Returns ``module``.
    """
    sync_module_over_mesh(module, device_mesh)
    if partition_fn is not None:
        for name, submodule in list(module.named_modules()):
            partition_fn(name, submodule, device_mesh)
    return module


def all_reduce_gradients(
    module: nn.Module,
    mesh: DeviceMesh,
    axes: Axis | Sequence[Axis],
    *,
    average: bool = False,
    check: bool = False,
) -> nn.Module:
    """Sum (or, with ``average``, average) every parameter's ``.grad`` over the mesh ``axes``.

    For data parallelism without FSDP. Gradients are flattened into one buffer per dtype and
    reduced with ONE all-reduce per bucket (per group: one world-wide group when ``axes`` span
    a mesh that is the whole job): a gloo collective has a latency floor of ~0.3 ms, so one
    collective per parameter would cost more than the bytes on a model with many small tensors.
    Parameters whose ``.grad`` is None are skipped, so every rank must have gradients on the same
    parameters (true after the same forward/backward); ``check=True`` verifies that first with
    one small extra collective, raising on every rank instead of hanging. Returns ``module``.
    """
    mesh_axes = resolve_axes(mesh, axes)
    named: list[tuple[str, torch.Tensor]] = []
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        _check_plain(name, param.grad, "gradient of")
        named.append((name, param.grad))
    groups = [g for g in groups_spanning(mesh, mesh_axes) if dist.get_world_size(g) > 1]
    if not named or not groups:
        return module
    if check:
        for group in groups:
            _check_same_layout(named, group, f"all_reduce_gradients over mesh axes {mesh_axes}")
    count = 1
    for mesh_axis in mesh_axes:
        count *= mesh.size(mesh_axis)
    with torch.no_grad():
        for grads in _buckets(g for _, g in named).values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            if flat.dtype == torch.bool:
                raise TypeError("cannot sum boolean gradients")
            for group in groups:
                reduced = collectives.all_reduce(_wire_view(flat), "sum", group)
                flat = torch.view_as_complex(reduced) if flat.is_complex() else reduced
            if average:
                flat = flat / count if flat.is_floating_point() or flat.is_complex() else flat // count
            for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(piece.view(grad.shape))
    return module
