"""Global moments (count, mean, M2) of sharded data: fused local kernels, a float64 merge of the few.

Normalization takes its local statistics from torch's fused row-moments kernel (the one inside
``native_group_norm``: one pass in the input's dtype, what torch's own normalization computes, and
it writes the rows normalized locally, which the normalization rescales in place), because
``torch.var`` on CPU is an order of magnitude slower on one thread.  The var/std
reductions must equal ``torch.var`` itself, so they use the slower exact path (a float64 sum for
the mean, then ``torch.var``).  Only the per-statistic results, whose number is that of the
statistics (e.g. N * groups) and never the grid size, are merged across ranks in float64 with
Chan et al.'s parallel algorithm: no E[x^2] - E[x]^2 cancellation, and an empty shard has count
0 and weighs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from ..distributed import collectives

__all__ = ["exact_local_moments", "merge_moments", "merge_over", "global_moments", "normalized_rows", "LOW_PRECISION"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def normalized_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused group-norm kernel on a (P, Q) tensor with Q > 0: (the rows normalized by their own
    statistics, (P, Q); their float64 means, 1 / std and M2).

    eps = 0 makes rstd = var^-1/2 exactly as computed (inf for a constant row, whose normalized
    values are then not finite), so M2 = Q / rstd^2.
    """
    p, q = rows.shape
    normalized, mean, rstd = torch.ops.aten.native_group_norm(rows.reshape(1, p, q), None, None, 1, p, q, p, 0.0)
    rstd = rstd.double().reshape(p)
    return normalized.view(p, q), mean.double().reshape(p), rstd, rstd.pow(-2) * q


def exact_local_moments(x: torch.Tensor, dims: Sequence[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, mean, M2) as ``torch.var`` computes them: the mean summed in float64.

    A mean rounded to the input dtype would carry its rounding error (an ulp of the offset, large
    for data far from zero) into the merged M2.
    """
    dims = tuple(dims)
    count = math.prod(x.shape[d] for d in dims)
    if x.numel() == 0:
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        zeros = torch.zeros(shape, dtype=torch.float64, device=x.device)
        return count, zeros, zeros.clone()
    mean = x.sum(dims, keepdim=True, dtype=torch.float64) / count
    m2 = torch.var(x, dims, correction=0, keepdim=True).double() * count
    return count, mean, m2


def merge_moments(
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


def merge_over(
    count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, groups: Sequence[ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`merge_moments` along each group in turn: the moments of the slabs of every rank."""
    for group in groups:
        count, mean, m2 = merge_moments(count, mean, m2, group)
    return count, mean, m2


def global_moments(
    x: torch.Tensor, dims: Sequence[int], groups: Sequence[ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (count, mean, M2) in float64 over ``dims`` of the slabs ``x``, as ``torch.var`` computes
    them (for the var/std reductions), merged along each group in turn.

    One all-gather of ``1 + 2 * stats`` values per group (a single one for the whole job).
    """
    count, mean, m2 = exact_local_moments(x, dims)
    return merge_over(torch.tensor(float(count), dtype=torch.float64, device=x.device), mean, m2, groups)
