"""Global moments (count, mean, variance) of sharded data: fused local kernels, a float64 merge of the few.

Normalization takes its local statistics from a fused row-moments kernel (on a CPU rank
:mod:`.fused_cpu`'s, one read of the slab, called by the norms themselves; elsewhere the one
inside ``native_group_norm``, which also writes the rows normalized locally, for the
normalization to rescale in place), because ``torch.var`` on CPU is an order of magnitude slower
on one thread.
The var/std reductions must equal ``torch.var`` itself, so they use the slower exact path (a float64 sum for
the mean, then ``torch.var``).  Only the per-statistic results, whose number is that of the
statistics (e.g. N * groups) and never the grid size, are merged across ranks in float64 with
Chan et al.'s parallel algorithm (the variance as the weighted mean of the parts' variances plus
their means' spread about the merged mean): no E[x^2] - E[x]^2 cancellation, and an empty shard
has count 0 and weighs nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..distributed.tracing import is_tracing
from . import fused_cpu

__all__ = [
    "exact_local_moments", "merge_moments", "merge_packed", "unpacked", "global_moments", "row_moments", "row_parts",
    "channels_last_parts", "per_channel_moments",
    "LOW_PRECISION",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def row_moments(rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Statistics of the rows of a (P, Q) tensor with Q > 0: (the rows normalized by their own
    statistics, (P, Q), or None; their means and 1 / std, (P,)), from one fused kernel.

    On the CPU the group-norm kernel, which also writes the normalized rows, for normalization to
    rescale in place (where :mod:`.fused_cpu` serves, the norms read their statistics without
    writing anything, and do not come here).  Eager CUDA takes synchronized batch
    norm's statistics kernel instead: there nothing rescales in place, and it reads the rows once
    and writes no slab-sized temporary; a few long rows are cut into parts (:func:`row_parts`)
    whose moments merge.
    eps = 0 makes rstd = var^-1/2 exactly as computed: inf for a constant row (whose
    normalized values are then not finite), so var = rstd^-2 is 0 there.
    """
    p, q = rows.shape  # the kernels take contiguous rows only (a strided view's rows are copied)
    rows = rows.reshape(1, p, q).contiguous()
    if rows.is_cuda and not is_tracing():
        parts = row_parts(p, q, rows.device)
        mean, rstd = torch.batch_norm_stats(rows.view(1, p * parts, q // parts), 0.0)
        rstd.masked_fill_(rstd == 0, math.inf)  # the kernel gives 0 for a constant row (var 0, eps 0)
        return None, *(merge_equal_parts(mean.view(p, parts), rstd.view(p, parts)) if parts > 1 else (mean, rstd))
    normalized, mean, rstd = torch.native_group_norm(rows, None, None, 1, p, q, p, 0.0)
    return normalized.view(p, q), mean.view(p), rstd.view(p)


def channels_last_parts(tokens: torch.Tensor, per_sample: bool) -> tuple[torch.Tensor, ...]:
    """The (N, L, C) view of a channels-last slab as the (N, C, L, 1) views that torch's per-channel
    batch-norm kernels read in their channels-last paths (a channels-last 4-D tensor, no copy): one
    per sample where the statistics are per sample, else the whole batch."""
    x4 = tokens.transpose(1, 2).unsqueeze(-1)
    return x4.split(1) if per_sample else (x4,)


def per_channel_moments(tokens: torch.Tensor, per_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, biased variance) of the (N, L, C) view of a channels-last slab, float64,
    shaped (N, C) (per sample) or (1, C) (over the batch), read in place.

    From torch's per-channel batch-norm statistics on :func:`channels_last_parts`: no transposed copy
    of the slab (copying it row-major for :func:`row_moments` costs several times the statistics
    themselves; ``var_mean`` over these dims, 15x the batch-norm kernel on a CPU thread).  On the
    CPU the kernel also writes the slab normalized (there is no statistics-only kernel).
    """
    means, variances = [], []
    for part in channels_last_parts(tokens, per_sample):
        if part.is_cuda and not is_tracing():
            mean, rstd = torch.batch_norm_stats(part, 0.0)
        else:
            _, mean, rstd = torch.native_batch_norm(part, None, None, None, None, True, 0.0, 0.0)
        means.append(mean.double())
        # both kernels give 1 / std = 0 for a constant channel (var 0, eps 0): var 0, not inf
        variances.append(rstd.double().pow(-2).masked_fill_(rstd == 0, 0.0))
    return torch.stack(means), torch.stack(variances)


_LONG_ROW = 1 << 20  # values per row above which a row's lone block of threads outlasts the parts' few extra kernels
_MIN_PART = 1 << 14  # values a part of a row keeps: enough work for a block of threads


def row_parts(rows: int, length: int, device: torch.device, batch: int = 1) -> int:
    """Into how many equal parts to cut each of ``rows`` rows (``batch`` runs of ``length``
    values each) before a per-row kernel.

    torch's CUDA kernels for per-row statistics and batch-norm reductions give each row (channel)
    one block of threads, so a few long rows (layer norm over a whole sample, group norm's
    N * groups rows) leave most of a GPU idle: layer norm over one 50M-value row took 157 ms
    forward and backward on an H100, 1.9 ms in parts.  Cut into parts, a row gets a block per
    part and the parts' results merge exactly.  Rows as many as the GPU's multiprocessors, or of
    at most ``_LONG_ROW`` values, stay whole: there the parts' few extra small kernels cost more
    than they save (on an H100, 1M-value rows lost 0.3 ms in parts, 1.5M-value rows gained 0.5).
    1 on the CPU (one thread per rank reads the rows in turn either way) and while tracing (the
    compiler splits reductions itself).
    """
    if device.type != "cuda" or is_tracing():
        return 1
    return _parts_dividing(rows, length, batch, _multiprocessors(device.index))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _parts_dividing(rows: int, length: int, batch: int, processors: int) -> int:
    """The largest k dividing ``length`` that keeps rows * k within about four blocks per
    processor and parts of at least ``_MIN_PART`` values; 1 for rows that need no cutting."""
    values = batch * length
    if not 0 < rows < processors or values <= _LONG_ROW:
        return 1
    most = min(-(-4 * processors // rows), values // _MIN_PART)
    return next((k for k in range(most, 1, -1) if length % k == 0), 1)


def merge_equal_parts(mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of (P, k) part statistics over equally many values each: (mean (P,), 1 / std (P,)),
    in the parts' dtype, merged in float64 (the variance as the mean of the parts' variances plus
    their means' spread; a constant row keeps rstd = inf).  Not :func:`_merged`: its weights
    (1 / k, inexact in binary) can move a constant row's mean by an ulp, and its rstd off inf."""
    means, variances = mean.double(), rstd.double().pow(-2)
    row_mean = means.mean(1, keepdim=True)
    var = (means - row_mean).square_().add_(variances).mean(1)
    return row_mean.view(-1).to(mean.dtype), var.rsqrt_().to(rstd.dtype)


def exact_local_moments(x: torch.Tensor, dims: Sequence[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, mean, biased variance) as ``torch.var`` computes them: the mean summed in float64.

    A mean rounded to the input dtype would carry its rounding error (an ulp of the offset, large
    for data far from zero) into the merged variance.
    """
    dims = tuple(dims)
    count = math.prod(x.shape[d] for d in dims)
    if x.numel() == 0:
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        zeros = torch.zeros(shape, dtype=torch.float64, device=x.device)
        return count, zeros, zeros.clone()
    mean = x.sum(dims, keepdim=True, dtype=torch.float64) / count
    var = torch.var(x, dims, correction=0, keepdim=True).double()
    return count, mean, var


def _merged(counts: torch.Tensor, means: torch.Tensor, variances: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan et al.'s merge of the rows of (R, S) means and biased variances, row ``r`` standing for
    ``counts[r]`` values ((R, 1)): (total (1,), mean (S,), variance (S,)).

    Seven small kernels: the weighted sums over the rows are matrix products with the (1, R)
    weights (each op here is a kernel launch on a GPU, where the norms' statistics are most of a
    sharded step's launches).
    """
    total = counts.sum(0)
    weights = (counts / total.clamp(min=1)).t()  # an empty part weighs nothing, an empty whole gives zeros
    mean = weights @ means
    deviation = means - mean
    return total, mean.view(-1), (weights @ torch.addcmul(variances, deviation, deviation)).view(-1)


@functools.lru_cache(maxsize=256)
def _cached_count(count: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # usable outside inference mode too (saved for backward)
        return torch.full((1,), float(count), dtype=torch.float64, device=device)


def _count(count: int, device: torch.device) -> torch.Tensor:
    """``count`` as a (1,) float64 tensor, made once per value and device (a fill kernel per norm
    otherwise); fresh while tracing (no global state in a graph).  Callers only read it."""
    if is_tracing():
        return torch.full((1,), float(count), dtype=torch.float64, device=device)
    return _cached_count(count, device)


def merge_moments(
    count: int, mean: torch.Tensor, var: torch.Tensor, groups: Sequence[ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The moments over every rank along ``groups`` (in turn) of statistics each rank holds for
    ``count`` of its values: (total count (1,), mean (S,), biased variance (S,)), float64.

    ``mean`` and ``var`` have S entries (any shape, any float dtype).  Each group costs one
    all-gather of ``1 + 2 * S`` float64 values; the merge is Chan's formula on those few values.
    """
    total = _count(count, mean.device)
    mean, var = mean.reshape(-1), var.reshape(-1)
    if not groups:  # statistics of the slab alone (e.g. to be averaged over a split batch): float64 all the same
        return total, mean.double(), var.double()
    if fused_cpu.usable(mean, var):
        return unpacked(merge_packed(torch.cat((total, mean, var)), groups))
    size = mean.numel()
    for group in groups:
        gathered = collectives.all_gather_rows(torch.cat((total, mean, var)), group)  # promoted to float64
        total, mean, var = _merged(gathered[:, :1], gathered[:, 1 : 1 + size], gathered[:, 1 + size :])
    return total, mean, var


def merge_packed(packed: torch.Tensor, groups: Sequence[ProcessGroup]) -> torch.Tensor:
    """:func:`merge_moments` of statistics packed as ``[count, means, variances]`` (float64), where
    :mod:`.fused_cpu` serves: one all-gather and one merge kernel per group."""
    for group in groups:
        packed = fused_cpu.merge_moments(collectives.all_gather_rows(packed, group))
    return packed


def unpacked(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count (1,), means (S,), variances (S,)): views of packed statistics."""
    stats = packed.numel() // 2
    return packed[:1], packed[1 : 1 + stats], packed[1 + stats :]


def global_moments(
    x: torch.Tensor, dims: Sequence[int], groups: Sequence[ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (count, mean, biased variance) in float64 over ``dims`` of the slabs ``x``, as
    ``torch.var`` computes them (for the var/std reductions), shaped as a keepdim reduction.

    One all-gather of ``1 + 2 * stats`` values per group (a single one for the whole job).
    """
    count, mean, var = exact_local_moments(x, dims)
    total, merged_mean, merged_var = merge_moments(count, mean, var, groups)
    return total, merged_mean.view_as(mean), merged_var.view_as(var)
