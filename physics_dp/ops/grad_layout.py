"""Gradients of sharded tensors stay in their tensors' own layouts.

Reductions hand their input's gradient back in the input's own layout, and a differentiable mean
runs as sum / count, whose backward is a view (see :func:`_mean_through_sum`).
Their backward expands a replicated (reduced) gradient to the input's shape; left alone, that
replicated, global-size gradient would flow upstream through every view, select and pointwise
op into a sharded leaf's ``.grad``.  Cutting it to the slab at the reduction costs no
communication (Replicate -> Shard is a local slice of an expanded view).

Autograd accumulates a non-contiguous gradient into a leaf by cloning it into
``new_empty_strided(leaf.shape, leaf.stride())``; a same-shape ``new_empty_strided`` takes the
source's split here (the DTensor rule would re-split it in the ``torch.chunk`` layout), and
``select_backward`` (a select's gradient, scattered into zeros) keeps the gradient's split.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..shard_tensor import Shard, ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import keep_grad_layout
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.fallback import propagate_and_run
from ..shard_tensor.spec import memory_order
from .reductions import accumulate_dtype

_REDUCTION_NAMES = "sum mean nansum var std var_mean std_mean amax amin max min logsumexp norm prod".split()


def _reduction_functions() -> list[Any]:
    functions = [getattr(owner, name) for name in _REDUCTION_NAMES for owner in (torch, torch.Tensor) if hasattr(owner, name)]
    return [*functions, torch.linalg.vector_norm]


def _keep_input_grad_layouts(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    if torch.is_grad_enabled() and "out" not in kwargs:
        args = tuple(keep_grad_layout(a) if isinstance(a, ShardTensor) else a for a in args)
    return run_default(func, args, kwargs)


def _mean_through_sum(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """A differentiable floating mean as ``sum / count``, so that its backward is an expand.

    torch's mean backward divides the expanded gradient, which writes the reduced tensor's global
    shape on every rank (the loss ``.mean()`` of a grid too large for one device would not fit)
    before the cut to the slab.  ``sum``'s backward only expands: the slab is a view and the
    division happens on the few reduced values.  CPU torch computes a mean as sum then division.
    """
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2]) if len(args) > 2 else bool(kwargs.get("keepdim", False))
    with torch._C.DisableTorchFunctionSubclass():  # the wrapper's metadata, without a __torch_function__ round trip each
        shape, requires_grad, dtype = x.shape, x.requires_grad, kwargs.get("dtype") or x.dtype
    if not (torch.is_grad_enabled() and requires_grad and dtype.is_floating_point) or "out" in kwargs:
        return _keep_input_grad_layouts(func, types, args, kwargs)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        dims = tuple(range(len(shape)))
    else:
        dims = tuple(d % len(shape) for d in ((dim,) if isinstance(dim, int) else dim))
    count = math.prod(shape[d] for d in dims)
    return (torch.sum(x, dims, keepdim=keepdim, dtype=accumulate_dtype(dtype)) / count).to(dtype)


for _func in _reduction_functions():  # layout-agnostic: strided inputs keep their layout too
    ShardTensor.register_function_handler(_func, _keep_input_grad_layouts, strided=True)
for _func in (torch.mean, torch.Tensor.mean):
    ShardTensor.register_function_handler(_func, _mean_through_sum, strided=True)


def _empty_like_layout(local_shape: torch.Size, stride: tuple[int, ...], like: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """An empty slab whose dims lie in memory in the order of the global ``stride``."""
    order = memory_order(stride)
    factory = {k: v for k, v in kwargs.items() if k in ("dtype", "device", "pin_memory") and v is not None}
    empty = like.new_empty([local_shape[d] for d in order], **factory)
    return empty.permute([order.index(d) for d in range(len(order))])


def _new_empty_strided(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    source, size, stride = args[:3]
    spec = source._spec
    if tuple(size) != tuple(spec.shape) or spec.has_partial:
        return propagate_and_run(op, args, kwargs)
    out_spec = ShardTensorSpec(spec.mesh, spec.placements, spec.shape, spec.axis_sizes, tuple(stride))
    return ShardTensor(_empty_like_layout(spec.local_shape(), tuple(stride), source._local_tensor, kwargs), out_spec)


ShardTensor.register_dispatch_handler(torch.ops.aten.new_empty_strided.default, _new_empty_strided)


def _select_backward(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    grad, input_sizes, dim, index = args
    dim = dim % len(input_sizes)
    if not isinstance(grad, ShardTensor) or kwargs:
        return propagate_and_run(op, args, kwargs)
    spec = grad._spec
    placements = [Shard(p.dim + (p.dim >= dim)) if type(p) is Shard else p for p in spec.placements]
    out_spec = ShardTensorSpec(spec.mesh, placements, input_sizes, spec.axis_sizes)
    local_sizes = out_spec.local_shape()
    return ShardTensor(op(grad._local_tensor, local_sizes, dim, index), out_spec)


ShardTensor.register_dispatch_handler(torch.ops.aten.select_backward.default, _select_backward)
