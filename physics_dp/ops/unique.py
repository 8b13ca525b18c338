"""``torch.unique`` of a sharded tensor (``dim=None``): the global unique values on every rank.

Each rank takes the unique values of its slab; along each mesh axis that shards the tensor the
ranks gather those (a few values each, never the slab) and take the unique of the union, so
every rank ends with the sorted global set, replicated.  ``return_inverse`` is each slab's
values looked up in that set (it keeps the input's split); ``return_counts`` is each slab's
counts of the set's values, summed over the sharding axes.  The result is sorted whatever
``sorted`` says, as torch's CPU and CUDA kernels sort it.

Raises for NaN (torch keeps each NaN apart, at its place in global order) and for ``dim`` over a
sharded tensor (unique slices that cross ranks).  The op has no gradient, as in torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed import collectives
from ..shard_tensor import Replicate, ShardTensor, ShardTensorSpec
from ..shard_tensor.dispatch import run_default
from ._local import ShardedOpError, sharded_axes

__all__: list[str] = []


def _global_values(slab: torch.Tensor, x: ShardTensor) -> torch.Tensor:
    values = torch.unique(slab)
    mesh = x.device_mesh
    for axis, _ in sharded_axes(x):
        group = mesh.get_group(axis)
        sizes = [n for (n,) in collectives.gather_sizes([values.numel()], group)]
        values = torch.unique(collectives.all_gather_along_dim(values, sizes, 0, group))
    return values


def _unique(
    input: ShardTensor, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False, dim: int | None = None
) -> Any:
    if dim is not None:
        raise ShardedOpError(
            "unique", [input], f"unique slices along dim {dim} span the sharded dims; use dim=None, or "
            "redistribute to Replicate first"
        )
    x = input.redistribute(placements=[Replicate() if p.is_partial() else p for p in input.placements])
    slab = x._local_tensor.detach()
    if slab.is_floating_point():
        has_nan = slab.isnan().any().to(torch.int32).view(1)
        for axis, _ in sharded_axes(x):
            has_nan = collectives.all_reduce(has_nan, "max", x.device_mesh.get_group(axis))
        if has_nan.item():
            raise ShardedOpError(
                "unique", [input], "the values hold NaN, which torch keeps apart one by one in global order; "
                "replace them first (torch.nan_to_num) or gather the tensor"
            )
    values = _global_values(slab, x)
    mesh = x.device_mesh
    replicated = ShardTensorSpec(mesh, [Replicate()] * mesh.ndim, values.shape, [None] * mesh.ndim)
    results: list[Any] = [ShardTensor(values, replicated)]
    searchable = torch.uint8 if slab.dtype == torch.bool else slab.dtype  # (searchsorted takes no bools)
    inverse = torch.searchsorted(values.to(searchable), slab.to(searchable)) if return_inverse or return_counts else None
    if return_inverse:
        results.append(ShardTensor(inverse, x._spec.replace()))
    if return_counts:
        counts = torch.bincount(inverse.reshape(-1), minlength=values.numel())
        for axis, _ in sharded_axes(x):
            counts = collectives.all_reduce(counts, "sum", mesh.get_group(axis))
        results.append(ShardTensor(counts, replicated))
    return results[0] if len(results) == 1 else tuple(results)


def _handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, ShardTensor):
        return run_default(func, args, kwargs)
    return _unique(*args, **kwargs)


for _func in (torch.unique, torch.Tensor.unique):
    ShardTensor.register_function_handler(_func, _handler)
