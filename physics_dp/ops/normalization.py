"""Sharded group, batch, instance and layer norm with exact global statistics.

Each op normalizes over a set of tensor dims; where a mesh axis shards one of them, the
statistics must span every rank along that axis:

- Forward: each rank computes (count, mean, M2) of its slab with a fused kernel; the ranks
  along each such axis all-gather these triples and merge them in float64 (:mod:`.moments`): one
  all-gather per axis (a single one over the job when the axes are the whole mesh) of
  ``1 + 2 * stats`` values, where ``stats`` is the number of statistics (e.g. N * groups), never
  the grid size.  y = x * a + b (a and b folded from the global statistics and the affine
  parameters) is then one pass: on a CPU rank :mod:`.fused_cpu`'s kernels (the statistics read x
  once and write nothing); else torch's moments kernel also wrote the slab normalized by its own
  rows' statistics, and that output is rescaled in place, which reads memory just written (a
  channels-last slab is read in place by batch norm's per-channel kernels, then one broadcast pass).
- Backward: with g = dL/dxhat, dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).  The sums of dy
  and dy * xhat per (sample, channel) come from one fused pass (:mod:`.fused_cpu`'s, else torch's
  batch-norm backward reduction) and are all-reduced in one message.  For the channel norms they
  give dx as alpha * dy + beta * x + gamma (one pass of :mod:`.fused_cpu`'s kernel, else two), and
  the affine parameters' gradients in closed form, already summed over the ranks sharing the
  statistics: no separate parameter all-reduce.

Without a sharded normalized dim (layer norm over unsharded trailing dims, group norm with only
the batch split, eval-mode batch norm) the op runs on the slab with no communication at all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..distributed.tracing import is_tracing
from ..shard_tensor import Replicate, ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import differentiable_slab, function_input, function_output, input_gradient, slab_gradient, taken_slab
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.spec import CHANNELS_LAST_ORDERS, in_spec_order, inverse_order
from . import fused_cpu
from .autocast import fp32_where_autocast_does
from ._local import (
    ShardedOpError, data_axes, groups_over, groups_spanning, local_input, local_param, sharded_axes, wrap_local_as,
)
from .grad_sums import SumGradOverGroups, creating_graph, sum_shares
from .moments import (
    LOW_PRECISION, channels_last_parts, merge_moments, merge_packed, per_channel_moments, row_moments, row_parts, unpacked,
)

__all__: list[str] = []


# ----- group, batch and instance norm: fused statistics, closed-form backward ------------------
class _StatLayout:
    """Which (N, C, L) entries share a statistic: ``groups`` runs of channels, per sample or not;
    ``channels_last``: the work is a channels-last slab viewed as (N, L, C) instead.

    Group norm: per (sample, group); instance norm: per (sample, channel) (groups = C); batch norm:
    per channel over the whole batch (``per_sample`` False, groups = C).  Statistics and the
    coefficients made from them are shaped (N or 1, groups, 1), so that they broadcast against
    (N, groups, channels per group) and against the per-parameter (groups, channels per group).
    """

    __slots__ = ("groups", "per_sample", "channels_last")

    def __init__(self, groups: int, per_sample: bool, channels_last: bool = False) -> None:
        self.groups, self.per_sample, self.channels_last = groups, per_sample, channels_last

    def sizes(self, x3: torch.Tensor) -> tuple[int, int, int]:
        """(N, C, L) of the work, whichever of the two views it is."""
        return (x3.shape[0], x3.shape[2], x3.shape[1]) if self.channels_last else tuple(x3.shape)

    def local_moments(self, x3: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, _LocalRows | None]:
        """(values per statistic, mean, biased variance) of the slab, shaped (N or 1, groups), and
        the slab normalized by the statistics of its own rows (None for an empty slab, for the
        (N, L, C) view of a channels-last one, and where :func:`.moments.row_moments` writes no
        normalized rows)."""
        n, c, length = self.sizes(x3)
        count = c // max(self.groups, 1) * length if self.per_sample else n * length
        if x3.numel() == 0:  # zero moments that weigh nothing in the merge
            zeros = torch.zeros(n if self.per_sample else 1, self.groups, dtype=torch.float64, device=x3.device)
            return count, zeros, zeros, None
        if self.channels_last:  # per channel, then each group's channels merged (equal counts), in float64
            channel_mean, channel_var = per_channel_moments(x3, self.per_sample)
            per_group = (-1, self.groups, c // self.groups)
            spread, mean = torch.var_mean(channel_mean.view(per_group), -1, correction=0)
            return count, mean, spread.add_(channel_var.view(per_group).mean(-1)), None
        normalized, mean, rstd = row_moments(x3.reshape(n * self.groups, -1) if self.per_sample else x3.reshape(n * c, length))
        local = None if normalized is None else _LocalRows(normalized.view(n, c, length), mean.view(n, -1, 1), rstd.view(n, -1, 1))
        var = rstd.double().pow(-2).view(n, -1)
        if self.per_sample or n == 1:  # a row is a (sample, group), or a channel of the one sample
            return count, mean.view(n, -1), var, local
        # a row is a (sample, channel): the samples' moments merged (equal counts), in float64
        spread, merged = torch.var_mean(mean.view(n, c).double(), 0, correction=0, keepdim=True)
        return count, merged, spread.add_(var.mean(0, keepdim=True)), local

    def expanded(self, per_stat: torch.Tensor, n: int, channels: int, dtype: torch.dtype, parts: int = 1) -> torch.Tensor:
        """A (N or 1, groups, 1 or channels per group) coefficient as the (N * C * parts,) vector
        of ``dtype`` a kernel takes (each channel's value ``parts`` times, for channels cut into parts)."""
        full: tuple[int, ...] = (n, self.groups, channels // self.groups)
        if parts > 1:
            per_stat, full = per_stat.unsqueeze(-1), (*full, parts)
        if per_stat.shape != full:  # (an expand of the full shape still costs a call)
            per_stat = per_stat.expand(full)
        return per_stat.to(dtype).reshape(-1)


class _LocalRows(NamedTuple):
    """The slab (N, C, L) normalized by its own rows' statistics, (N, rows per sample, 1) each."""

    normalized: torch.Tensor
    mean: torch.Tensor
    rstd: torch.Tensor  # inf where a row is constant


class _Output(NamedTuple):
    """A norm Function's output as a ShardTensor: its spec, and its dtype (the input's; the work may run in fp32)."""

    spec: ShardTensorSpec
    dtype: torch.dtype


def _returned(ctx, y: torch.Tensor, out: _Output | None) -> torch.Tensor:
    """A norm Function's result: its work ``y`` as ``out``'s ShardTensor (noting the work's shape and
    dtype, which the output's gradient returns to), or ``y`` itself (plain slabs, or an affine to follow)."""
    ctx.out = out
    if out is None:
        return y
    ctx.work = (y.shape, y.dtype)
    shape = out.spec.local_shape()
    if ctx.layout.channels_last:  # the (N, L, C) work is the channels-last slab's memory
        order = CHANNELS_LAST_ORDERS[len(shape)]
        local = y.view([shape[d] for d in order]).permute(inverse_order(order))
    else:
        local = y.view(shape)
        local = local if out.spec.is_contiguous() else in_spec_order(local, out.spec)
    return function_output(local.to(out.dtype), out.spec)


def _work_gradient(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the work a norm Function returned through :func:`_returned`."""
    if ctx.out is None:
        return grad
    shape, dtype = ctx.work
    grad = slab_gradient(grad, ctx.out.spec)
    if ctx.layout.channels_last:
        grad = grad.permute(CHANNELS_LAST_ORDERS[grad.ndim])
    return grad.reshape(shape).to(dtype)


@functools.lru_cache(maxsize=64)
def _constants(size: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(zeros, ones, an empty tensor): the running statistics of an identity batch norm, and a
    scratch output.  Made once per size (the kernels only read them; making them costs as much as
    the small kernels they serve)."""
    with torch.inference_mode(False):  # usable outside inference mode too
        return (torch.zeros(size, dtype=dtype, device=device), torch.ones(size, dtype=dtype, device=device),
                torch.empty(0, dtype=dtype, device=device))


def _identity_stats(size: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_constants` for ``like``'s dtype and device; fresh ones while tracing (no global state in a graph)."""
    if is_tracing():
        return like.new_zeros(size), like.new_ones(size), like.new_empty(0)
    return _constants(size, like.dtype, like.device)


def _rescaled(local: _LocalRows, scale: torch.Tensor, shift: torch.Tensor, layout: _StatLayout) -> torch.Tensor | None:
    """x * scale + shift computed in place from the locally normalized slab, or None where it cannot be.

    x = normalized / rstd + mean, so the result is normalized * (scale / rstd) + (mean * scale + shift):
    one pass over the kernel's own output, just written, instead of one over x into a new tensor.
    A constant row (rstd = inf) has no finite normalized values, so the caller computes from x.
    Only eager and on the CPU: the check is data-dependent (a compiled graph fuses the pass over x
    anyway) and would make a GPU wait.
    """
    normalized = local.normalized
    if is_tracing() or normalized.device.type != "cpu" or not normalized.is_contiguous():
        return None  # (a non-contiguous slab would be reshaped into a copy, and the copy rescaled)
    if math.isinf(local.rstd.max()):  # (the largest, read as a float: 3x cheaper than isinf then any)
        return None
    return _scale_shift(normalized, scale / local.rstd, torch.addcmul(shift, local.mean, scale), layout, in_place=True)


def _scale_shift(
    x3: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, layout: _StatLayout, in_place: bool = False
) -> torch.Tensor:
    """x3 * scale + shift with coefficients per (sample, channel), in one fused pass (over x3 itself if ``in_place``).

    Eval-mode batch norm with mean 0 and variance 1 computes exactly ``x * weight + bias`` per
    channel; viewing (N, C, L) as one sample of N * C channels gives per-(sample, channel) values.
    Its CPU kernel reads each element before writing the same element, so it may write over its
    input: one pass where ``mul_`` then ``add_`` take two.  On a GPU a few long channels are cut
    into parts (:func:`.moments.row_parts`), each with the channel's coefficients.  (Where
    :mod:`.fused_cpu` serves, the norms call its per-row kernel instead: up to 1.4x faster.)
    """
    if x3.numel() == 0:  # an empty shard (the kernel cannot take zero channels)
        return x3 if in_place else torch.empty_like(x3)
    if layout.channels_last:  # (N, L, C): one broadcast pass writes the channels-last output
        return torch.addcmul(_per_token(layout, x3, shift), x3, _per_token(layout, x3, scale))
    n, c, length = x3.shape
    parts = 1 if in_place else row_parts(n * c, length, x3.device)
    weight, bias = layout.expanded(scale, n, c, x3.dtype, parts), layout.expanded(shift, n, c, x3.dtype, parts)
    zeros, ones, scratch = _identity_stats(n * c * parts, x3)
    rows = x3.reshape(1, n * c * parts, length // parts)
    if not in_place:
        return torch.batch_norm(rows, weight, bias, zeros, ones, False, 0.0, 0.0, False).view(n, c, length)
    torch.native_batch_norm(rows, weight, bias, zeros, ones, False, 0.0, 0.0, out=(rows, scratch, scratch))
    return x3


def _dy_and_x_terms(
    grad: torch.Tensor, x3: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, layout: _StatLayout
) -> torch.Tensor:
    """a * grad + b * x3 + c for (N, C, L) tensors and per-statistic coefficients (see
    :meth:`_StatLayout.expanded`).

    Two passes: ``x3 * b + c`` into a new tensor (:func:`_scale_shift`), then ``addcmul_`` of
    ``a * grad`` (no stock kernel reads three tensors; :mod:`.fused_cpu`'s does, where it serves).
    """
    if x3.numel() == 0:  # an empty shard (it may hold no statistic at all)
        return torch.empty_like(x3)
    if layout.channels_last:  # (N, L, C): broadcast passes, channels-last output
        return torch.addcmul(_per_token(layout, x3, c), x3, _per_token(layout, x3, b)).addcmul_(grad, _per_token(layout, x3, a))
    n, channels, length = x3.shape
    out = _scale_shift(x3, b, c, layout)
    return out.addcmul_(grad, layout.expanded(a, n, channels, grad.dtype).view(n, channels, 1))


def _row_sums(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Per channel of the (N, C, L) tensors: the sums of dy and of dy * (x - mean), stacked (2, C), float64.

    torch's batch-norm backward reduces both in one pass over ``grad`` and ``x`` (two separate
    reductions read the gradient twice); given 1 / std = 1 it leaves the scaling to the caller.
    The weight (ones) must be given: CUDA's reduction reads its device.  On a GPU a few long
    channels are cut into parts (:func:`.moments.row_parts`) whose sums add up.  (Where
    :mod:`.fused_cpu` serves, the norms take its kernel instead: 2-3x faster on one thread.)
    """
    n, channels, length = x.shape
    if x.numel() == 0:  # an empty shard (the kernel divides by its extents)
        return torch.zeros(2, channels, dtype=torch.float64, device=x.device)
    parts = row_parts(channels, length, x.device, batch=n)
    if parts > 1:
        split = (n, channels * parts, length // parts)
        grad, x, mean = grad.reshape(split), x.reshape(split), mean.repeat_interleave(parts)
    _, ones, _ = _identity_stats(channels * parts, x)
    _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
        grad, x, ones, None, None, mean, ones, True, 0.0, [False, True, True]
    )
    sums = torch.stack((sum_dy, sum_dy_xmu)).double()
    return sums.view(2, channels, parts).sum(-1) if parts > 1 else sums


def _per_token(layout: _StatLayout, tokens: torch.Tensor, per_stat: torch.Tensor) -> torch.Tensor:
    """A per-statistic coefficient as the (N, 1, C) tensor that broadcasts along the tokens of an (N, L, C) view."""
    n, _, channels = tokens.shape
    return layout.expanded(per_stat, n, channels, tokens.dtype).view(n, 1, channels)


def _channel_sums_channels_last(grad: torch.Tensor, tokens: torch.Tensor, mean: torch.Tensor, per_sample: bool) -> torch.Tensor:
    """:func:`_row_sums` of the (N, L, C) views of channels-last slabs: per (sample, channel), or per channel over the
    batch, (2, N * C or C), float64.

    From torch's batch-norm backward reduction on :func:`.moments.channels_last_parts` of both: no
    transposed copy of either.  ``mean`` has a value per summed (sample,) channel.
    """
    channels = tokens.shape[2]
    _, ones, _ = _identity_stats(channels, tokens)
    parts = zip(channels_last_parts(grad, per_sample), channels_last_parts(tokens, per_sample), mean.split(channels))
    sums = []
    for part_grad, part, part_mean in parts:
        _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
            part_grad, part, ones, None, None, part_mean, ones, True, 0.0, [False, True, True]
        )
        sums.append(torch.stack((sum_dy, sum_dy_xmu)))
    return torch.cat(sums, 1).double()


class _ChannelNorm(torch.autograd.Function):
    """Group, batch or instance norm with statistics over the global grid, affine included.

    Forward: fused local moments, one all-gather of the float64 statistics per group, merged,
    then y = x * a + b in one pass (on the stock kernels, from the moments kernel's own output, in
    place: :func:`_rescaled`; for the (N, L, C) view of a channels-last slab, batch norm's
    per-channel kernels and a broadcast pass over the slab's own memory).  Backward: the
    per-(sample, channel) sums of dy and dy * (x - mean) (one fused pass), all-reduced in one message, give dx = a * dy + beta * x + gamma
    (:func:`_dy_and_x_terms`) and the weight and bias gradients in closed form (already summed
    over the ranks that share the statistics).  Where :mod:`.fused_cpu` serves, each step is one
    of its kernels (:func:`_normalize_on_cpu_kernels`).

    Given ``out``, it returns the output as that ShardTensor (:func:`.conversions.function_output`):
    one autograd node per norm, not a conversion node after it.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x3: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        layout: _StatLayout,
        groups: tuple[ProcessGroup, ...],
        eps: float,
        out: _Output | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x3, weight, bias)
        ctx.layout, ctx.groups, ctx.eps = layout, groups, eps
        ctx.has_bias = bias is not None
        ctx.on_cpu_kernels = fused_cpu.usable(x3)
        if ctx.on_cpu_kernels:
            y, ctx.stats = _normalize_on_cpu_kernels(x3, weight, bias, layout, groups, eps)
            total, mean, var = unpacked(ctx.stats[0])
        else:
            y, total, mean, var = _channel_norm_on_stock_kernels(ctx, x3, weight, bias)
        ctx.total = total
        mean, var = mean.view(-1, layout.groups), var.view(-1, layout.groups)
        ctx.mark_non_differentiable(mean, var)
        ctx.set_materialize_grads(False)  # the statistics get no gradient: no zeros made for them
        return _returned(ctx, y, out), mean, var  # the statistics in float64, for the running averages

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _mean_grad: None, _var_grad: None):  # type: ignore[override]
        grad = _work_gradient(ctx, grad)
        if creating_graph():
            return (*_differentiated(ctx, grad, _channel_norm_again), None, None, None, None)
        grad = grad.contiguous()
        if not ctx.on_cpu_kernels:
            return (*_channel_norm_backward_on_stock_kernels(ctx, grad), None, None, None, None)
        x3, weight, _ = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                 ctx.has_bias and ctx.needs_input_grad[2])
        grad_x, grad_weight, grad_bias = _normalize_backward_on_cpu_kernels(
            grad, x3, weight, ctx.stats, ctx.layout, ctx.groups, needs
        )
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_x, grad_weight, None if grad_bias is None else grad_bias.to(grad.dtype), None, None, None, None


def _channel_norm_on_stock_kernels(ctx, x3: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None):
    """The forward from torch's kernels and small tensor ops: (y, total count, mean, var)."""
    layout = ctx.layout
    per_group = (layout.groups, layout.sizes(x3)[1] // layout.groups)
    count, mean, var, local = layout.local_moments(x3)
    total, mean, var = merge_moments(count, mean, var, ctx.groups)
    mean, var = mean.view(-1, layout.groups, 1), var.view(-1, layout.groups, 1)
    rstd = (var + ctx.eps).rsqrt_()
    scale = rstd if weight is None else rstd * weight.view(per_group)  # float64: the parameters promote
    shift = (mean * scale).neg_() if bias is None else torch.addcmul(bias.view(per_group), mean, scale, value=-1)
    y = None if local is None else _rescaled(local, scale, shift, layout)
    y = _scale_shift(x3, scale, shift, layout) if y is None else y
    ctx.stats = (mean, rstd, scale)
    return y, total, mean, var


def _channel_norm_backward_on_stock_kernels(ctx, grad: torch.Tensor) -> tuple:
    """(dx, dweight, dbias) from torch's kernels and small tensor ops."""
    x3, weight, _ = ctx.saved_tensors
    mean, rstd, scale = ctx.stats
    total = ctx.total
    layout = ctx.layout
    n, channels, length = layout.sizes(x3)
    per_group = (layout.groups, channels // layout.groups)
    mean_c = layout.expanded(mean, n if layout.per_sample else 1, channels, x3.dtype)
    if layout.channels_last:  # the (N, L, C) view of a channels-last slab
        sums = _channel_sums_channels_last(grad, x3, mean_c, layout.per_sample)
    elif layout.per_sample:  # statistics per (sample, channel): one row each
        rows = (1, n * channels, length)
        sums = _row_sums(grad.view(rows), x3.reshape(rows), mean_c)
    else:  # batch statistics: the kernel sums the rank's part of the batch too
        sums = _row_sums(grad, x3, mean_c)
    for group in ctx.groups:
        sums = collectives.all_reduce(sums, "sum", group)
    sums = sums.view(2, -1, *per_group)  # over the global grid: sum dy, sum dy * (x - mean)
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        # g = dL/dxhat = w * dy; dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) = scale * dy + beta * x + gamma
        # with k = -rstd / n: beta = k * rstd^2 * sum(g * (x - mean)), gamma = k * sum(g) - beta * mean
        weighted = sums if weight is None else sums * weight.view(per_group)
        k_sum_g, k_sum_g_xmu = weighted.sum(-1, keepdim=True) * (rstd / -total)
        beta = k_sum_g_xmu * rstd.square()
        gamma = torch.addcmul(k_sum_g, beta, mean, value=-1)
        grad_x = _dy_and_x_terms(grad, x3, scale, beta, gamma, layout)
    if weight is not None and ctx.needs_input_grad[1]:
        grad_weight = _over_samples(sums[1] * rstd).view(-1).to(weight.dtype)  # sum of dy * xhat
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = _over_samples(sums[0]).view(-1).to(grad.dtype)
    return grad_x, grad_weight, grad_bias


def _normalize_on_cpu_kernels(
    x3: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, layout: _StatLayout,
    groups: tuple[ProcessGroup, ...], eps: float,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The normalization of an (N, C, L) slab (or (N, L, C), per ``layout``) from :mod:`.fused_cpu`'s kernels, five calls: the
    slab's statistics, their merge over the ranks, the coefficients, then y = scale * x + shift.
    Returns y and the statistics the backward takes (packed moments, 1 / std, coefficients)."""
    stats = _cpu_statistics(x3, weight, bias, layout, groups, eps)
    coefficients = stats[2]
    if layout.channels_last:
        return fused_cpu.channels_last_affine(x3, coefficients[0], coefficients[1]), stats
    n, channels, length = x3.shape
    y = fused_cpu.row_affine(x3.view(n * channels, length), coefficients[0], coefficients[1]).view(n, channels, length)
    return y, stats


def _cpu_statistics(
    x3: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, layout: _StatLayout,
    groups: tuple[ProcessGroup, ...], eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed moments merged over the ranks, 1 / std, rows (scale, shift, mean) per (sample, channel))
    of an (N, C, L) slab, or of the (N, L, C) view of a channels-last one (``layout.channels_last``),
    from :mod:`.fused_cpu`'s kernels."""
    n, channels, _ = layout.sizes(x3)
    moments_of = fused_cpu.channels_last_moments if layout.channels_last else fused_cpu.norm_moments
    moments = moments_of(x3, layout.groups, layout.per_sample)
    packed = merge_packed(moments, groups)
    coefficients, rstd = fused_cpu.norm_coefficients(
        packed, weight, bias, eps, (n, channels), layout.groups, layout.per_sample, x3.dtype
    )
    return packed, rstd, coefficients


def _normalize_backward_on_cpu_kernels(
    grad: torch.Tensor, x3: torch.Tensor, weight: torch.Tensor | None, stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    layout: _StatLayout, groups: tuple[ProcessGroup, ...], needs: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias) (float64 parameter gradients; None where ``needs`` says no) from
    :mod:`.fused_cpu`'s kernels: the sums of dy and dy * (x - mean) per (sample, channel),
    all-reduced, the coefficients, then dx in one pass."""
    coefficients = stats[2]
    n, channels, length = layout.sizes(x3)
    rows = (n * channels, length)
    if layout.channels_last:
        mean = coefficients[2] if layout.per_sample else coefficients[2, :channels]
        sums = fused_cpu.channels_last_grad_sums(grad, x3, mean, layout.per_sample)
    elif layout.per_sample:  # statistics per (sample, channel): one row each
        sums = fused_cpu.grad_sums(grad.view(1, *rows), x3.view(1, *rows), coefficients[2])
    else:  # batch statistics: the kernel sums the rank's part of the batch too
        sums = fused_cpu.grad_sums(grad, x3, coefficients[2, :channels])
    terms, param_grads = _grad_terms(sums, stats, weight, n, layout, groups, x3.dtype)
    grad_x = None
    if needs[0] and layout.channels_last:
        grad_x = fused_cpu.channels_last_two_term_affine(grad, x3, coefficients[0], terms[0], terms[1])
    elif needs[0]:
        grad_x = fused_cpu.two_term_affine(grad.view(rows), x3.view(rows), coefficients[0], terms[0], terms[1])
        grad_x = grad_x.view(n, channels, length)
    return grad_x, param_grads[0] if needs[1] else None, param_grads[1] if needs[2] else None


def _grad_terms(
    sums: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor], weight: torch.Tensor | None, samples: int,
    layout: _StatLayout, groups: tuple[ProcessGroup, ...], dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's rows (beta, gamma) and per-channel parameter gradients from a rank's sums of
    g and g * (x - mean), all-reduced first (one message per group)."""
    packed, rstd, _ = stats
    for group in groups:
        sums = collectives.all_reduce(sums, "sum", group)
    return fused_cpu.norm_grad_coefficients(sums, packed, rstd, weight, samples, layout.groups, layout.per_sample, dtype)


def _layer_norm_backward_on_cpu_kernels(
    grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    layout: _StatLayout, groups: tuple[ProcessGroup, ...], input_grad: bool, param_grads: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Layer norm's (dx, dweight, dbias) for (R, Q) rows and their elementwise (Q,) weight (None where
    not asked for): one pass for the sums through the weight and the parameters' gradients, the
    all-reduce (every rank takes part, asked or not), one pass for dx."""
    coefficients = stats[2]  # rows (1 / std, shift, mean): no per-row weight
    sums, grads = fused_cpu.weighted_grad_sums(grad, rows, weight, coefficients[2], coefficients[0], param_grads)
    terms, _ = _grad_terms(sums, stats, None, 1, layout, groups, rows.dtype)
    grad_x = None
    if input_grad:
        grad_x = fused_cpu.two_term_affine_elementwise(grad, rows, weight, coefficients[0], terms[0], terms[1])
    return grad_x, grads[0] if param_grads else None, grads[1] if param_grads else None


def _over_samples(per_stat: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 (samples) of per-statistic values; a view where there is one (batch
    statistics, a rank's single sample), not a copy kernel."""
    return per_stat[0] if per_stat.shape[0] == 1 else per_stat.sum(0)


def _channel_norm(
    x: ShardTensor,
    local: torch.Tensor,
    layout: _StatLayout,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    stat_dims: Sequence[int],
    eps: float,
    keeps_channels_last: bool,
) -> tuple[ShardTensor, torch.Tensor, torch.Tensor]:
    """Normalize the slab ``local`` of ``x`` with statistics over ``stat_dims`` of the global tensor:
    the output ShardTensor, and the statistics (float64, for running averages).  A channels-last
    input gives a channels-last output where ``keeps_channels_last`` (as torch's op does).

    The affine parameters' gradients come out of the statistics' all-reduce already summed over
    the axes that shard ``stat_dims``; only the remaining data axes (e.g. a split batch in group
    norm) still sum them.
    """
    stat_axes = [axis for axis, dim in sharded_axes(x) if dim in stat_dims]
    other_axes = [axis for axis in data_axes(x) if axis not in stat_axes]
    w, b = local_param(weight, x, other_axes), local_param(bias, x, other_axes)
    work = local.float() if local.dtype in LOW_PRECISION else local
    tokens = _channels_last_work(x, work) if keeps_channels_last else None
    if tokens is not None:  # the slab's own memory, channels innermost
        x3, layout = tokens, _StatLayout(layout.groups, layout.per_sample, channels_last=True)
    else:
        x3 = work.reshape(work.shape[0], work.shape[1], math.prod(work.shape[2:]))
    groups = tuple(groups_spanning(x.device_mesh, tuple(stat_axes)))
    return _ChannelNorm.apply(x3, w, b, layout, groups, eps, _Output(_output_spec(x, keeps_channels_last), local.dtype))


def _channels_last_work(x: ShardTensor, work: torch.Tensor) -> torch.Tensor | None:
    """A channels-last slab as the (N, L, C) view of its memory, which both :mod:`.fused_cpu`'s
    channels-last kernels and the stock kernels' channels-last paths read in place; None for other
    layouts (their rows are copied out row-major)."""
    if not x._spec.is_channels_last():
        return None
    tokens = work.permute(CHANNELS_LAST_ORDERS[work.ndim])
    return tokens.reshape(tokens.shape[0], -1, tokens.shape[-1]) if tokens.is_contiguous() else None


# ----- layer norm over sharded dims: global statistics per leading index -----------------------
class _NormalizeGlobally(torch.autograd.Function):
    """xhat = (x - mean) / sqrt(var + eps), with mean and var over the trailing ``dims`` of the global tensor.

    The slab is viewed as rows (leading index) x the normalized values, (1, rows, values): one
    sample whose channels are the rows, so the channel norms' pieces apply with a statistic per
    channel.  On the stock kernels the normalization rescales the moments kernel's own output
    (:func:`_rescaled`) and the closed-form backward is fused per-row passes of xhat
    (:func:`_scale_shift`); where :mod:`.fused_cpu` serves, it is the channel norms' kernel path,
    whose backward reads x (saved anyway) instead of xhat.  Low-precision
    slabs are normalized in fp32 (the output's dtype); the input itself is kept, uncast, for a
    double backward (a reference, as torch's layer norm keeps its input).  Given ``out``, the result
    is returned as that ShardTensor, as :class:`_ChannelNorm` does.  The input is the ShardTensor
    itself (:func:`.conversions.function_input`; its slab while tracing): no conversion node before
    the Function either.  A double backward then takes its slab again differentiably, so that
    second-order gradients reach the input's producers.

    The slab's part of the elementwise affine parameters (``weight``, and ``bias`` only with it) is
    taken on :mod:`.fused_cpu`'s path only: there its kernels apply them in the normalization's own
    passes, as torch's fused layer norm does, where a separate ``addcmul`` and its backward took
    three more passes (the handler keeps that elsewhere).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, input: torch.Tensor, dims: tuple[int, ...], groups: tuple[ProcessGroup, ...], eps: float,
        out: _Output | None = None, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        slab = taken_slab(ctx, input)
        ctx.dtype = slab.dtype
        x = slab.float() if slab.dtype in LOW_PRECISION else slab
        length = math.prod(x.shape[d] for d in dims)  # dims are the trailing ones
        leading = math.prod(x.shape[: x.ndim - len(dims)])  # each leading index is a row
        layout = _StatLayout(leading, per_sample=True)
        rows = x.reshape(1, leading, length)
        ctx.groups, ctx.dims, ctx.eps, ctx.layout = groups, dims, eps, layout
        ctx.on_cpu_kernels = fused_cpu.usable(rows)
        if ctx.on_cpu_kernels:  # the backward then reads x itself: the channel norms' kernel path
            ctx.save_for_backward(rows, input, weight, bias)
            if weight is None:
                y, ctx.stats = _normalize_on_cpu_kernels(rows, None, None, layout, groups, eps)
            else:
                ctx.weight = weight.to(x.dtype).reshape(length)  # the slab's part, contiguous
                ctx.stats = _cpu_statistics(rows, None, None, layout, groups, eps)
                coefficients = ctx.stats[2]
                b = None if bias is None else bias.to(x.dtype).reshape(length)
                y = fused_cpu.row_affine_elementwise(rows.view(leading, length), coefficients[0], coefficients[1], ctx.weight, b)
            ctx.count = unpacked(ctx.stats[0])[0]
            return _returned(ctx, y.view(x.shape), out)
        if weight is not None or bias is not None:
            raise RuntimeError("layer norm's affine parameters enter its Function on the fused CPU kernels' path only")
        count, mean, var, local = layout.local_moments(rows)
        ctx.count, mean, var = merge_moments(count, mean, var, groups)
        rstd = (var + eps).rsqrt_().view(1, leading, 1)
        shift = (mean.view(1, leading, 1) * rstd).neg_()
        xhat = None if local is None else _rescaled(local, rstd, shift, layout)
        xhat = (_scale_shift(rows, rstd, shift, layout) if xhat is None else xhat).view(x.shape)
        ctx.save_for_backward(xhat, rstd, input)
        return _returned(ctx, xhat, out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        needs = ctx.needs_input_grad
        if not (needs[0] or needs[5] or needs[6]):
            return (None,) * 7
        grad = _work_gradient(ctx, grad)
        if creating_graph():
            return tuple(_differentiated(ctx, grad, _normalize_again))
        grad = grad.contiguous()
        if ctx.on_cpu_kernels:
            rows, _, weight, bias = ctx.saved_tensors
            if weight is None:
                grad_x, _, _ = _normalize_backward_on_cpu_kernels(
                    grad.view(rows.shape), rows, None, ctx.stats, ctx.layout, ctx.groups, (True, False, False)
                )
                return input_gradient(ctx, grad_x.view(grad.shape).to(ctx.dtype)), None, None, None, None, None, None
            leading, length = rows.shape[1:]
            grad_x, grad_w, grad_b = _layer_norm_backward_on_cpu_kernels(
                grad.view(leading, length), rows.view(leading, length), ctx.weight, ctx.stats, ctx.layout, ctx.groups,
                needs[0], needs[5] or needs[6],
            )
            return (
                None if grad_x is None else input_gradient(ctx, grad_x.view(grad.shape).to(ctx.dtype)), None, None, None, None,
                grad_w.view(weight.shape).to(weight.dtype) if needs[5] else None,
                grad_b.view(bias.shape).to(bias.dtype) if bias is not None and needs[6] else None,
            )
        xhat, rstd, _ = ctx.saved_tensors
        layout = ctx.layout
        rows = (1, layout.groups, xhat.numel() // layout.groups if layout.groups else 0)
        xhat_rows, grad_rows = xhat.view(rows), grad.view(rows)
        zeros, _, _ = _identity_stats(layout.groups, xhat)  # xhat is centered already
        sums = _row_sums(grad_rows, xhat_rows, zeros)
        for group in ctx.groups:
            sums = collectives.all_reduce(sums, "sum", group)
        # dx = rstd * (dy - mean(dy) - xhat * mean(dy * xhat)): its shift and xhat's coefficient, per row
        shift, xhat_coefficient = sums.view(2, 1, -1, 1) * (rstd / -ctx.count)
        grad_x = _dy_and_x_terms(grad_rows, xhat_rows, rstd, xhat_coefficient, shift, layout).view(grad.shape)
        return input_gradient(ctx, grad_x.to(ctx.dtype)), None, None, None, None, None, None


# ----- double backward: the forward again, from differentiable pieces --------------------------
def _differentiated(ctx, grad: torch.Tensor, again: Callable[..., tuple]) -> list[torch.Tensor | None]:
    """Gradients of the inputs ``again(ctx)`` names, as differentiable functions of them and ``grad``.

    Under ``create_graph`` the closed-form backward (in-place, non-differentiable all-reduce) is
    replaced by differentiating the normalization written with :func:`.grad_sums.sum_shares`: one
    more forward's work, paid only by a double backward.
    """
    output, inputs = again(ctx)
    wanted = [t for t, need in zip(inputs, ctx.needs_input_grad) if need and t is not None]
    grads = iter(torch.autograd.grad(output, wanted, grad, create_graph=True) if wanted else ())
    return [next(grads) if need and t is not None else None for t, need in zip(inputs, ctx.needs_input_grad)]


def _channel_norm_again(ctx) -> tuple[torch.Tensor, tuple]:
    """Group, batch or instance norm of the saved slab (see :class:`_ChannelNorm`), differentiably."""
    work, weight, bias = ctx.saved_tensors
    layout, groups, total = ctx.layout, ctx.groups, ctx.total
    x3 = work.transpose(1, 2) if layout.channels_last else work  # (N, C, L)
    n, c, length = x3.shape
    per_group = (layout.groups, c // layout.groups)
    xd = x3.double()
    sums = torch.stack([xd.sum(2), xd.square().sum(2)])  # per (sample, channel)
    if not layout.per_sample:
        sums = sums.sum(1, keepdim=True)
    s1, s2 = sum_shares(sums.view(2, -1, *per_group).sum(-1, keepdim=True), groups)  # (N or 1, groups, 1) each
    mean = s1 / total
    rstd = torch.rsqrt(s2 / total - mean.square() + ctx.eps)
    y = ((xd.reshape(n, *per_group, length) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).view(n, c, length)
    if weight is not None:  # the statistics' ranks each hold a share of the affine gradients
        y = y * SumGradOverGroups.apply(weight, groups).double().unsqueeze(-1)
    if bias is not None:
        y = y + SumGradOverGroups.apply(bias, groups).double().unsqueeze(-1)
    y = y.transpose(1, 2) if layout.channels_last else y
    return y.to(work.dtype), (work, weight, bias)


def _normalize_again(ctx) -> tuple[torch.Tensor, tuple]:
    """Layer norm's normalization of the saved slab (see :class:`_NormalizeGlobally`), its affine
    parameters' slab applied where the Function took them, differentiably."""
    saved, count, dims = ctx.saved_tensors, ctx.count, ctx.dims
    input, weight, bias = saved[1:] if ctx.on_cpu_kernels else (saved[2], None, None)
    x = differentiable_slab(input)
    xd = x.double()  # the forward's output is fp32 for a low-precision slab: see the return
    s1, s2 = sum_shares(torch.stack([xd.sum(dims, keepdim=True), xd.square().sum(dims, keepdim=True)]), ctx.groups)
    mean = s1 / count
    y = (xd - mean) * torch.rsqrt(s2 / count - mean.square() + ctx.eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(torch.promote_types(x.dtype, torch.float32)), (input, None, None, None, None, weight, bias)


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


# torch's op on a tiny tensor, asked under autocast whether it runs in fp32 (see .autocast)
_AUTOCAST_PROBES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "group_norm": lambda t: F.group_norm(t, 1),
    "batch_norm": lambda t: F.batch_norm(t, None, None, training=True),
    "instance_norm": F.instance_norm,
    "layer_norm": lambda t: F.layer_norm(t, (2,)),
}


def _output_spec(x: ShardTensor, keeps_channels_last: bool) -> ShardTensorSpec:
    """Normalization keeps the input's shape, placements and split: a contiguous input's very spec,
    and a channels-last one's where torch's op keeps channels last (group and batch norm; instance
    and layer norm return row-major)."""
    if x._spec.is_contiguous() or (keeps_channels_last and x._spec.is_channels_last()):
        return x._spec
    return ShardTensorSpec(x.device_mesh, x.placements, x.shape, x._spec.axis_sizes)


def _finish(y: torch.Tensor, x: ShardTensor, keeps_channels_last: bool = False) -> ShardTensor:
    """The output of a norm computed outside the norms' Functions (no sharded normalized dim; layer norm's affine)."""
    return wrap_local_as(y, _output_spec(x, keeps_channels_last))


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
    """torch's running update, one ``lerp_`` each: the variance uses the unbiased correction with the global count."""
    if running_mean is not None:
        running_mean.lerp_(mean.reshape(-1).to(running_mean.dtype), momentum)
    if running_var is not None:
        unbiased = var.reshape(-1) * (count / max(count - 1, 1))
        running_var.lerp_(unbiased.to(running_var.dtype), momentum)


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
    if input._spec.ndim < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {input._spec.ndim}")
    x = _prepare(fp32_where_autocast_does(input, _AUTOCAST_PROBES["group_norm"]), "group_norm", channel_dim=1)
    channels = x._spec.shape[1]
    if channels % num_groups:
        raise RuntimeError(
            f"Expected number of channels in input to be divisible by num_groups, got {channels} and {num_groups}"
        )
    local = local_input(x)
    spatial = tuple(range(2, x._spec.ndim))
    if not groups_over(x, spatial):
        return _finish(F.group_norm(local, num_groups, local_param(weight, x), local_param(bias, x), eps), x, True)
    y, _, _ = _channel_norm(x, local, _StatLayout(num_groups, per_sample=True), weight, bias, spatial, eps, True)
    return y


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
    x = _prepare(fp32_where_autocast_does(input, _AUTOCAST_PROBES["batch_norm"]), "batch_norm", channel_dim=1)
    dims = (0, *range(2, x._spec.ndim))
    count = math.prod(x._spec.shape[d] for d in dims)
    if training:
        _verify_values_per_channel(count, "value per channel", x._spec.shape)
    local = local_input(x)
    rm, rv = _local_buffer(running_mean), _local_buffer(running_var)
    if not training or not groups_over(x, dims):
        w, b = local_param(weight, x), local_param(bias, x)
        return _finish(F.batch_norm(local, rm, rv, w, b, training, momentum, eps), x, True)
    layout = _StatLayout(x._spec.shape[1], per_sample=False)
    y, mean, var = _channel_norm(x, local, layout, weight, bias, dims, eps, True)
    _update_running(rm, rv, mean, var, count, momentum)
    return y


# ----- instance norm --------------------------------------------------------------------------
def _batch_average(stat: torch.Tensor, x: ShardTensor) -> torch.Tensor:
    """Mean over the global batch of per-instance statistics (batch dim 0 may be sharded)."""
    total = stat.sum(0)
    for group in groups_over(x, (0,)):
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
    x = _prepare(fp32_where_autocast_does(input, _AUTOCAST_PROBES["instance_norm"]), "instance_norm", channel_dim=1)
    dims = tuple(range(2, x._spec.ndim))
    count = math.prod(x._spec.shape[d] for d in dims)
    if use_input_stats:
        _verify_values_per_channel(count, "spatial element", x._spec.shape)
    local = local_input(x)
    rm, rv = _local_buffer(running_mean), _local_buffer(running_var)
    tracks_running = rm is not None or rv is not None
    batch_split = bool(groups_over(x, (0,)))  # then running statistics average over ranks
    if not use_input_stats or not (groups_over(x, dims) or (batch_split and tracks_running)):
        w, b = local_param(weight, x), local_param(bias, x)
        if not use_input_stats:  # running statistics per channel: batch norm's eval transform, local
            return _finish(F.batch_norm(local, rm, rv, w, b, False, momentum, eps), x)
        return _finish(F.instance_norm(local, rm, rv, w, b, True, momentum, eps), x)
    layout = _StatLayout(x._spec.shape[1], per_sample=True)
    y, mean, var = _channel_norm(x, local, layout, weight, bias, dims, eps, False)
    if tracks_running:
        _update_running(rm, rv, _batch_average(mean, x), _batch_average(var, x), count, momentum)
    return y


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
    shape = input._spec.shape
    first = len(shape) - len(normalized_shape)
    if first < 0 or tuple(shape[first:]) != normalized_shape:
        raise RuntimeError(
            f"Given normalized_shape={list(normalized_shape)}, expected input with shape [*, "
            f"{', '.join(map(str, normalized_shape))}], but got input of size{list(shape)}"
        )
    x = _prepare(fp32_where_autocast_does(input, _AUTOCAST_PROBES["layer_norm"]), "layer_norm", channel_dim=None)
    w, b = local_param(weight, x), local_param(bias, x)
    dims = tuple(range(first, len(shape)))
    groups = groups_over(x, dims)
    if not groups:
        return _finish(F.layer_norm(local_input(x), normalized_shape, w, b, eps), x)
    w, b = _slab_of_param(w, x, first), _slab_of_param(b, x, first)
    local = x._local_tensor  # its layout and dtype: the Function takes x itself (one node, no conversion before it)
    if (w is None and b is None) or (w is not None and fused_cpu.usable(local)):  # one node, the affine in its passes
        return _NormalizeGlobally.apply(function_input(x), dims, groups, eps, _Output(_output_spec(x, False), local.dtype), w, b)
    xhat = _NormalizeGlobally.apply(function_input(x), dims, groups, eps)
    if w is not None and b is not None:  # one pass: 2.4x faster than a mul then an add on a 4 MiB slab
        y = torch.addcmul(b, xhat, w)
    else:
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
