"""Global moments (count, mean, variance) of sharded data: fused local kernels, a float64 merge of the few.

Normalization takes its local statistics from torch's fused row-moments kernel (the one inside
``native_group_norm``: one pass in the input's dtype, what torch's own normalization computes, and
it writes the rows normalized locally, which the normalization rescales in place), because
``torch.var`` on CPU is an order of magnitude slower on one thread.  The var/std
reductions must equal ``torch.var`` itself, so they use the slower exact path (a float64 sum for
the mean, then ``torch.var``).  Only the per-statistic results, whose number is that of the
statistics (e.g. N * groups) and never the grid size, are merged across ranks in float64 with
Chan et al.'s parallel algorithm (the variance as the weighted mean of the parts' variances plus
their means' spread about the merged mean): no E[x^2] - E[x]^2 cancellation, and an empty shard
has count 0 and weighs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..distributed.tracing import is_tracing

__all__ = ["exact_local_moments", "merge_moments", "global_moments", "row_moments", "LOW_PRECISION"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def row_moments(rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Statistics of the rows of a (P, Q) tensor with Q > 0: (the rows normalized by their own
    statistics, (P, Q), or None; their means and 1 / std, (P,)), from one fused kernel.

    On the CPU the group-norm kernel also writes the normalized rows, which normalization
    rescales in place.  Eager CUDA takes synchronized batch norm's statistics kernel instead:
    there nothing rescales in place, and it reads the rows once and writes no slab-sized
    temporary.  eps = 0 makes rstd = var^-1/2 exactly as computed: inf for a constant row (whose
    normalized values are then not finite), so var = rstd^-2 is 0 there.
    """
    p, q = rows.shape  # the kernels take contiguous rows only (a strided view's rows are copied)
    rows = rows.reshape(1, p, q).contiguous()
    if rows.is_cuda and not is_tracing():
        mean, rstd = torch.batch_norm_stats(rows, 0.0)
        return None, mean, rstd
    normalized, mean, rstd = torch.native_group_norm(rows, None, None, 1, p, q, p, 0.0)
    return normalized.view(p, q), mean.view(p), rstd.view(p)


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
    ``counts[r]`` values ((R, 1)): (total (1,), mean (S,), variance (S,)), in a handful of ops."""
    total = counts.sum(0)
    weights = counts / total.clamp(min=1)  # an empty part weighs nothing, an empty whole gives zeros
    mean = (weights * means).sum(0)
    spread = (means - mean).square_().add_(variances)
    return total, mean, spread.mul_(weights).sum(0)


def merge_moments(
    count: int, mean: torch.Tensor, var: torch.Tensor, groups: Sequence[ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The moments over every rank along ``groups`` (in turn) of statistics each rank holds for
    ``count`` of its values: (total count (1,), mean (S,), biased variance (S,)), float64.

    ``mean`` and ``var`` have S entries (any shape, any float dtype).  Each group costs one
    all-gather of ``1 + 2 * S`` float64 values; the merge is Chan's formula on those few values.
    """
    total = torch.full((1,), float(count), dtype=torch.float64, device=mean.device)
    mean, var = mean.reshape(-1), var.reshape(-1)
    if not groups:  # statistics of the slab alone (e.g. to be averaged over a split batch): float64 all the same
        return total, mean.double(), var.double()
    size = mean.numel()
    for group in groups:
        gathered = collectives.all_gather_rows(torch.cat((total, mean, var)), group)  # promoted to float64
        total, mean, var = _merged(gathered[:, :1], gathered[:, 1 : 1 + size], gathered[:, 1 + size :])
    return total, mean, var


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
