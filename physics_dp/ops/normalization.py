"""Sharded group, batch, instance and layer norm with exact global statistics.

Each op normalizes over a set of tensor dims; where a mesh axis shards one of them, the
statistics must span every rank along that axis:

- Forward: each rank computes (count, mean, M2) of its slab; the ranks along each such axis
  all-gather these triples and merge them with Chan et al.'s parallel algorithm: one all-gather
  per axis (a single one over the job when the axes are the whole mesh) of ``1 + 2 * stats``
  float64 values, where ``stats`` is the number of statistics (e.g. N * groups), never the grid
  size.  No E[x^2] - E[x]^2 cancellation; an empty shard has count 0 and weighs nothing.
- Backward: with g = dL/dxhat, dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); the local sums
  of g and g * xhat are packed into one all-reduce per axis (again a single one over the job).
  Affine parameters enter through ``local_param`` (its backward all-reduces their gradients).

Without a sharded normalized dim (layer norm over unsharded trailing dims, group norm with only
the batch split, eval-mode batch norm) the op runs on the slab with no communication at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..shard_tensor import Replicate, ShardTensor
from ..shard_tensor.dispatch import run_default
from ._local import ShardedOpError, groups_spanning, local_input, local_param, sharded_axes, wrap_local

__all__ = ["global_moments"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# ----- statistics -----------------------------------------------------------------------------
def _local_moments(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, M2) of the slab over ``dims`` (keepdim) in float64; zeros for an empty slab.

    The mean is summed in float64: a mean rounded to the input dtype would carry its rounding
    error (an ulp of the offset, large for data far from zero) into the merged M2.
    """
    count = math.prod(x.shape[d] for d in dims)
    if x.numel() == 0:
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        mean = m2 = torch.zeros(shape, dtype=torch.float64, device=x.device)
    else:
        mean = x.sum(dims, keepdim=True, dtype=torch.float64) / count
        m2 = torch.var(x, dims, correction=0, keepdim=True).double() * count
    return torch.tensor(float(count), dtype=torch.float64, device=x.device), mean, m2


def _merge_moments(
    count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan et al.'s merge of every rank's (count, mean, M2) along ``group``: one all-gather."""
    size = mean.numel()
    packed = torch.cat([count.reshape(1), mean.reshape(-1), m2.reshape(-1)])
    parts = torch.distributed.get_world_size(group)
    gathered = collectives.all_gather_along_dim(packed.unsqueeze(0), [1] * parts, 0, group)
    counts, means, m2s = gathered[:, :1], gathered[:, 1 : 1 + size], gathered[:, 1 + size :]
    total = counts.sum()
    merged_mean = (counts * means).sum(0) / total.clamp(min=1)
    merged_m2 = m2s.sum(0) + (counts * (means - merged_mean) ** 2).sum(0)
    return total, merged_mean.view_as(mean), merged_m2.view_as(m2)


def global_moments(
    x: torch.Tensor, dims: tuple[int, ...], groups: Sequence[ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (count, mean, M2) in float64 over ``dims`` of the slabs ``x``, merged along each group in turn.

    Shared with the var/std reductions.  One all-gather of ``1 + 2 * stats`` values per group.
    """
    count, mean, m2 = _local_moments(x, dims)
    for group in groups:
        count, mean, m2 = _merge_moments(count, mean, m2, group)
    return count, mean, m2


class _NormalizeGlobally(torch.autograd.Function):
    """xhat = (x - mean) / sqrt(var + eps), with mean and var over ``dims`` of the global tensor.

    Also returns the (non-differentiable) mean and biased variance for running statistics.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, dims: tuple[int, ...], groups: tuple[ProcessGroup, ...], eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        count, mean, m2 = global_moments(x, dims, groups)
        count = count.clamp(min=1)
        mean, var = mean.to(x.dtype), (m2 / count).to(x.dtype)
        count = count.to(x.dtype)
        rstd = torch.rsqrt(var + eps)
        xhat = (x - mean) * rstd
        ctx.save_for_backward(xhat, rstd, count)
        ctx.dims, ctx.groups = dims, groups
        ctx.mark_non_differentiable(mean, var)
        return xhat, mean, var

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _mean_grad: torch.Tensor, _var_grad: torch.Tensor):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        xhat, rstd, count = ctx.saved_tensors
        sums = torch.stack([grad.sum(ctx.dims, keepdim=True), (grad * xhat).sum(ctx.dims, keepdim=True)])
        for group in ctx.groups:
            sums = collectives.all_reduce(sums, "sum", group)
        mean_grad, mean_grad_xhat = sums / count
        return rstd * (grad - mean_grad - xhat * mean_grad_xhat), None, None, None


# ----- shared pieces --------------------------------------------------------------------------
def _prepare(x: ShardTensor, op: str, channel_dim: int | None) -> ShardTensor:
    """Resolve pending reductions (normalization is not linear) and refuse a split channel dim."""
    if channel_dim is not None and any(dim == channel_dim for _, dim in sharded_axes(x)):
        raise ShardedOpError(
            op, [x], f"the channel dim {channel_dim} is sharded; per-channel parameters and statistics need every "
            "channel on each rank: shard the batch or spatial dims instead"
        )
    if x._spec.has_partial:
        x = x.redistribute(placements=[Replicate() if p.is_partial() else p for p in x.placements])
    return x


def _groups_over(x: ShardTensor, dims: Sequence[int]) -> tuple[ProcessGroup, ...]:
    """Process groups spanning the mesh axes that shard any of ``dims`` (one group for the whole job)."""
    return tuple(groups_spanning(x.device_mesh, tuple(axis for axis, dim in sharded_axes(x) if dim in dims)))


def _finish(y: torch.Tensor, x: ShardTensor) -> ShardTensor:
    """Normalization keeps the input's shape, placements and split."""
    return wrap_local(y, like=x, shape=x.shape, axis_sizes=x._spec.axis_sizes)


def _normalize(
    local: torch.Tensor, dims: tuple[int, ...], groups: tuple[ProcessGroup, ...], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global-statistics normalization of a slab; low precision computes in float32."""
    work = local.float() if local.dtype in _LOW_PRECISION else local
    return _NormalizeGlobally.apply(work, dims, groups, eps)


def _channel_affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y * weight + bias with per-channel (dim 1) parameters."""
    shape = [1, -1] + [1] * (y.ndim - 2)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


def _local_buffer(buffer: torch.Tensor | None) -> torch.Tensor | None:
    """A running-statistics buffer as the plain tensor to update in place (replicated ShardTensors too)."""
    return buffer._local_tensor if isinstance(buffer, ShardTensor) else buffer


@torch.no_grad()
def _update_running(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: int,
    momentum: float,
) -> None:
    """torch's running update: the variance uses the unbiased correction with the global count."""
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(mean.reshape(-1).to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        unbiased = var.reshape(-1) * (count / max(count - 1, 1))
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


def _verify_values_per_channel(count: int, what: str, shape: torch.Size) -> None:
    """torch's check that batch statistics see more than one value (skipped by the handler path)."""
    if count == 1:
        raise ValueError(f"Expected more than 1 {what} when training, got input size {shape}")


# ----- group norm -----------------------------------------------------------------------------
def _group_norm(
    input: ShardTensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> ShardTensor:
    if input.ndim < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {input.ndim}")
    x = _prepare(input, "group_norm", channel_dim=1)
    channels = x.shape[1]
    if channels % num_groups:
        raise RuntimeError(
            f"Expected number of channels in input to be divisible by num_groups, got {channels} and {num_groups}"
        )
    local = local_input(x)
    w, b = local_param(weight, x), local_param(bias, x)
    groups = _groups_over(x, range(2, x.ndim))
    if not groups:
        return _finish(F.group_norm(local, num_groups, w, b, eps), x)
    inner = channels // num_groups * math.prod(local.shape[2:])
    xhat, _, _ = _normalize(local.reshape(local.shape[0], num_groups, inner), (2,), groups, eps)
    y = _channel_affine(xhat.reshape(local.shape), w, b)
    return _finish(y.to(local.dtype), x)


# ----- batch norm -----------------------------------------------------------------------------
def _batch_norm(
    input: ShardTensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> ShardTensor:
    x = _prepare(input, "batch_norm", channel_dim=1)
    dims = (0, *range(2, x.ndim))
    count = math.prod(x.shape[d] for d in dims)
    if training:
        _verify_values_per_channel(count, "value per channel", x.shape)
    local = local_input(x)
    w, b = local_param(weight, x), local_param(bias, x)
    rm, rv = _local_buffer(running_mean), _local_buffer(running_var)
    groups = _groups_over(x, dims)
    if not training or not groups:
        return _finish(F.batch_norm(local, rm, rv, w, b, training, momentum, eps), x)
    xhat, mean, var = _normalize(local, dims, groups, eps)
    _update_running(rm, rv, mean, var, count, momentum)
    return _finish(_channel_affine(xhat, w, b).to(local.dtype), x)


# ----- instance norm --------------------------------------------------------------------------
def _batch_average(stat: torch.Tensor, x: ShardTensor) -> torch.Tensor:
    """Mean over the global batch of per-instance statistics (batch dim 0 may be sharded)."""
    total = stat.sum(0)
    for group in _groups_over(x, (0,)):
        total = collectives.all_reduce(total, "sum", group)
    return total / x.shape[0]


def _instance_norm(
    input: ShardTensor,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> ShardTensor:
    x = _prepare(input, "instance_norm", channel_dim=1)
    dims = tuple(range(2, x.ndim))
    count = math.prod(x.shape[d] for d in dims)
    if use_input_stats:
        _verify_values_per_channel(count, "spatial element", x.shape)
    local = local_input(x)
    w, b = local_param(weight, x), local_param(bias, x)
    rm, rv = _local_buffer(running_mean), _local_buffer(running_var)
    if not use_input_stats:  # running statistics per channel: batch norm's eval transform, local
        return _finish(F.batch_norm(local, rm, rv, w, b, False, momentum, eps), x)
    groups = _groups_over(x, dims)
    tracks_running = rm is not None or rv is not None
    batch_split = bool(_groups_over(x, (0,)))  # then running statistics average over ranks
    if not (groups or (batch_split and tracks_running)):
        return _finish(F.instance_norm(local, rm, rv, w, b, True, momentum, eps), x)
    xhat, mean, var = _normalize(local, dims, groups, eps)
    if tracks_running:
        _update_running(rm, rv, _batch_average(mean, x), _batch_average(var, x), count, momentum)
    return _finish(_channel_affine(xhat, w, b).to(local.dtype), x)


# ----- layer norm -----------------------------------------------------------------------------
def _slab_of_param(param: torch.Tensor | None, x: ShardTensor, first_dim: int) -> torch.Tensor | None:
    """The part of a ``normalized_shape`` parameter that lines up with this rank's slab."""
    if param is None:
        return None
    offsets, local_shape = x.offsets(), x._spec.local_shape()
    for _, dim in sharded_axes(x):
        if dim >= first_dim:
            param = param.narrow(dim - first_dim, offsets[dim], local_shape[dim])
    return param


def _layer_norm(
    input: ShardTensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> ShardTensor:
    normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    first = input.ndim - len(normalized_shape)
    if first < 0 or tuple(input.shape[first:]) != normalized_shape:
        raise RuntimeError(
            f"Given normalized_shape={list(normalized_shape)}, expected input with shape [*, "
            f"{', '.join(map(str, normalized_shape))}], but got input of size{list(input.shape)}"
        )
    x = _prepare(input, "layer_norm", channel_dim=None)
    local = local_input(x)
    w, b = local_param(weight, x), local_param(bias, x)
    dims = tuple(range(first, x.ndim))
    groups = _groups_over(x, dims)
    if not groups:
        return _finish(F.layer_norm(local, normalized_shape, w, b, eps), x)
    xhat, _, _ = _normalize(local, dims, groups, eps)
    w, b = _slab_of_param(w, x, first), _slab_of_param(b, x, first)
    y = xhat if w is None else xhat * w
    y = y if b is None else y + b
    return _finish(y.to(local.dtype), x)


# ----- registration ---------------------------------------------------------------------------
def _handler(implementation: Callable[..., ShardTensor]) -> Callable[[Any, tuple, tuple, dict], Any]:
    """A function handler calling ``implementation`` with the original arguments.

    A call where only a parameter is a ShardTensor (the input is plain) is left to torch.
    """

    def handle(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
        if not isinstance(args[0] if args else kwargs.get("input"), ShardTensor):
            return run_default(func, args, kwargs)
        return implementation(*args, **kwargs)

    return handle


for _func, _implementation in (
    (F.group_norm, _group_norm),
    (F.batch_norm, _batch_norm),
    (F.instance_norm, _instance_norm),
    (F.layer_norm, _layer_norm),
):
    ShardTensor.register_function_handler(_func, _handler(_implementation))
