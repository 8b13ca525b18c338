"""Softmax and log-softmax over a sharded dim, at the aten level, with the output sharded as the input.

DTensor's rule for ``_softmax`` over a sharded dim replicates that dim: every rank then holds,
and every later op computes on, the whole tensor.  A softmax only needs two numbers per row from
the other ranks, its maximum and its sum of exponentials:

- forward: the local maximum along the dim, all-reduced (max); ``exp(x - max)`` on the slab; its
  local sum, all-reduced (sum); then ``exp(x - max) / sum`` or ``x - max - log(sum)``, the formulas
  torch's kernels use;
- backward (``_softmax_backward_data``, ``_log_softmax_backward_data``): ``y * (g - sum(g * y))``
  and ``g - exp(y) * sum(g)``, the sum all-reduced.

Each all-reduce is the size of the output with the dim removed, never of the input.  A NaN in a
row reaches every rank through the sum (torch gives that row NaN as well).  Without a sharded
softmax dim the op runs on the slab.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..shard_tensor import ShardTensor
from ..shard_tensor.redistribute import without_partials
from ._local import contiguous_result, groups_over, slab_as
from .moments import LOW_PRECISION

__all__: list[str] = []

aten = torch.ops.aten


def _row_total(value: torch.Tensor, dim: int, reduce_op: str, groups: Sequence[ProcessGroup]) -> torch.Tensor:
    """The sum or max of ``value`` along ``dim`` over every rank's slab, kept as a size-1 dim."""
    if reduce_op == "max":
        if value.shape[dim] == 0:  # an empty shard: the identity of max
            shape = [1 if d == dim else n for d, n in enumerate(value.shape)]
            total = torch.full(shape, -math.inf, dtype=value.dtype, device=value.device)
        else:
            total = value.amax(dim, keepdim=True)
    else:
        total = value.sum(dim, keepdim=True)
    for group in groups:
        if total.numel():  # every rank of a group has the same row count, so all skip together
            total = collectives.all_reduce(total, reduce_op, group)
    return total


def _forward(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    x, dim, half_to_float = args
    spec = without_partials(x._spec)
    dim %= max(x.ndim, 1)
    groups = groups_over(x, (dim,))
    local = slab_as(x, spec)
    if not groups:
        return contiguous_result(op(local, dim, half_to_float), spec)
    work = local.float() if local.dtype in LOW_PRECISION else local  # as torch's kernels compute
    shifted = work - _row_total(work, dim, "max", groups)
    exps = shifted.exp()
    total = _row_total(exps, dim, "sum", groups)
    y = shifted - total.log() if op is aten._log_softmax.default else exps.div_(total)
    return contiguous_result(y.to(torch.float32 if half_to_float else local.dtype), spec)


def _backward(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    grad, output, dim, input_dtype = args
    spec = without_partials(output._spec)
    dim %= max(output.ndim, 1)
    groups = groups_over(output, (dim,))
    y, g = slab_as(output, spec), slab_as(grad, spec)
    if not groups:
        return contiguous_result(op(g, y, dim, input_dtype), spec)
    if y.dtype in LOW_PRECISION:
        y, g = y.float(), g.float()
    if op is aten._log_softmax_backward_data.default:
        dx = g - y.exp() * _row_total(g, dim, "sum", groups)
    else:
        dx = y * (g - _row_total(g * y, dim, "sum", groups))
    return contiguous_result(dx.to(input_dtype), spec)


for _op, _handler in (
    (aten._softmax.default, _forward),
    (aten._log_softmax.default, _forward),
    (aten._softmax_backward_data.default, _backward),
    (aten._log_softmax_backward_data.default, _backward),
):
    ShardTensor.register_dispatch_handler(_op, _handler)
