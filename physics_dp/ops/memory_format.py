"""The memory layout of a stencil op's output: channels last where torch's own op gives it.

torch's convolutions, pooling, interpolation, padding (but circular) and group and batch norm keep a
channels-last input channels last (a convolution also when only its weight is), and channels-last models
(``model.to(memory_format=torch.channels_last)``) rely on it: their kernels are the fast ones for
that layout.  Wrapped row-major instead, every op's output was copied, and the next convolution
reordered it back: a channels-last StormCast step on 2 ranks took 1.30x the row-major one.  The
layout is decided from global information (the input's spec, the weight), the same on every rank:
a kernel's own output layout can differ on a rank whose slab has 0 or 1 rows.
"""

from __future__ import annotations

import torch

from ..shard_tensor import ShardTensor, ShardTensorSpec
from ..shard_tensor.spec import CHANNELS_LAST_ORDERS, channels_last_order, in_memory_order

__all__ = ["output_order", "in_output_layout", "weight_like_output"]


def output_order(x: ShardTensor, weight: torch.Tensor | None = None) -> tuple[int, ...] | None:
    """The dims of the output of a stencil op on ``x`` (and ``weight``, for a convolution) from
    outermost to innermost in memory where torch gives channels last, else None (row-major)."""
    ndim = x._spec.ndim
    order = CHANNELS_LAST_ORDERS.get(ndim)
    if order is None:
        return None
    if x._spec.is_channels_last():
        return order
    if weight is not None and weight.ndim == ndim and channels_last_order(weight) is not None:
        return order
    return None


def in_output_layout(spec: ShardTensorSpec, order: tuple[int, ...] | None) -> ShardTensorSpec:
    """``spec`` (row-major) laid out as ``order`` says (itself for None)."""
    return spec if order is None else spec.in_order(order)



def weight_like_output(weight: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    """A convolution's local weight in its output's layout: channels last (a small, differentiable
    copy) where the output is and the weight is not (an FSDP-sharded model keeps row-major
    parameters).  Why: given a row-major weight, the convolution's backward returns a row-major
    input gradient, which a channels-last slab then copies back; given a channels-last one, its own."""
    order = CHANNELS_LAST_ORDERS.get(weight.ndim)
    if order is None or not spec.is_channels_last() or channels_last_order(weight) is not None:
        return weight
    return in_memory_order(weight, order)
