"""The common convolution, stride 1 and 'same' along one sharded dim, without copying the slab.

A convolution is linear in its input, so the output of a slab with its halo rows equals the
plain convolution of the slab alone (zero padded: torch's own op on the rank's data, no copy)
plus the contribution of the halo rows, which only reaches the first and last ``r`` output
rows (``r`` = the padding, half the kernel's span).  The halo exchange starts first, the slab's
convolution runs while it is in flight, then each received halo is convolved with the few
kernel rows whose taps reach it (one row of a 3x3 kernel) and added to the boundary rows.
The backward mirrors it: the output gradient's ``r`` boundary rows travel to the neighbours
while the slab's ``convolution_backward`` runs (only the gradients autograd asks for), then the
neighbours' rows add their share to the boundary of the input gradient, and the halos add theirs
to those kernel rows' weight gradient.  A double backward (``create_graph=True``) instead
differentiates the same convolution written with the differentiable window gather (:mod:`.halo`):
slower, but only that case pays for it.

Eligible: stride 1, zero padding ``r`` on both sides with ``2 r`` equal to the kernel's span,
one sharded spatial dim, and every shard at least ``r`` rows (halos come from adjacent ranks
only).  Everything else takes the general window-gather path in :mod:`.conv`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..distributed import collectives
from .halo import exchange_boundary_rows, gather_window, received_rows, uniform_windows, with_extent
from .grad_sums import creating_graph

__all__ = ["HaloConvGeometry", "halo_conv", "autocast_inputs", "differentiated_rerun", "in_input_dtypes"]

_CONV_BY_DIMS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class HaloConvGeometry:
    """Everything but the tensors: the sharded dim, its reach, and the conv's own arguments."""

    dim: int  # tensor dim of the sharded spatial dim
    reach: int  # r: rows needed from each neighbour
    padding: tuple[int, ...]  # per spatial dim, for the slab's own convolution
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    group: ProcessGroup
    sizes: tuple[int, ...]  # the split of the sharded dim over ``group``
    has_prev: bool
    has_next: bool

    def strip_padding(self) -> tuple[int, ...]:
        """The halo strips are convolved without padding along the sharded dim."""
        padding = list(self.padding)
        padding[self.dim - 2] = 0
        return tuple(padding)

    def reaching_rows(self, kernel: int, before: bool) -> tuple[int, int]:
        """(first, count) of the kernel rows along the sharded dim whose taps reach a halo.

        ``before``: the previous rank's rows, reached from the first ``r`` outputs by the rows
        k with k * dilation < r; else the next rank's, reached from the last ``r`` by those with
        k * dilation > r.
        """
        dilation, r = self.dilation[self.dim - 2], self.reach
        if before:
            return 0, (r - 1) // dilation + 1
        first = -(-(r + 1) // dilation)
        return first, kernel - first

    def strip_gap(self, count: int) -> int:
        """Zero rows between a halo and the ``r`` output rows it reaches through ``count`` kernel rows (0 for 3 rows)."""
        return (count - 1) * self.dilation[self.dim - 2]


def _exchange_rows(local: torch.Tensor, geometry: HaloConvGeometry) -> collectives.PendingExchange:
    """The ``r`` boundary rows each way: the forward's input halo and the backward's output-gradient halo."""
    r_prev, r_next = geometry.reach * geometry.has_prev, geometry.reach * geometry.has_next
    return exchange_boundary_rows(local, geometry.dim, geometry.group, r_prev, r_next, r_prev, r_next)


def _strip(halo: torch.Tensor, geometry: HaloConvGeometry, count: int, before: bool) -> torch.Tensor:
    """The rows that ``count`` kernel rows see around a boundary, only the halo's nonzero: ``r`` output rows' worth.

    The halo, then zeros in place of the slab's rows (before), or zeros then the halo; for a
    kernel of 3 rows it is the halo alone.
    """
    gap = geometry.strip_gap(count)
    if gap == 0:
        return halo
    zeros = halo.new_zeros(with_extent(halo.shape, geometry.dim, gap))
    return torch.cat([halo, zeros] if before else [zeros, halo], geometry.dim)


def _conv_backward(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, geometry: HaloConvGeometry, mask: list[bool]):
    """``convolution_backward`` of a halo strip (no padding along the sharded dim)."""
    return torch.ops.aten.convolution_backward(
        grad, input, weight, None, geometry.stride, geometry.strip_padding(), geometry.dilation, False,
        [0] * len(geometry.padding), geometry.groups, mask,
    )


class _HaloConv(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geometry: HaloConvGeometry
    ) -> torch.Tensor:
        conv = _CONV_BY_DIMS[local.ndim - 2]
        dim, r = geometry.dim, geometry.reach
        ctx.dtypes = (local.dtype, weight.dtype, None if bias is None else bias.dtype)
        local, weight, bias = autocast_inputs(local, weight, bias)  # the backward then sees one dtype
        pending = _exchange_rows(local, geometry)
        y = conv(local, weight, bias, geometry.stride, geometry.padding, geometry.dilation, geometry.groups)
        prev_rows, next_rows = received_rows(pending, geometry.group)
        strips, boundaries = [], []  # boundaries: (first output row corrected, whether the halo comes before)
        for rows, start, before in ((prev_rows, 0, True), (next_rows, y.shape[dim] - r, False)):
            if rows is None:
                continue
            first, count = geometry.reaching_rows(weight.shape[dim], before)
            strip = _strip(rows, geometry, count, before)
            part = weight.narrow(dim, first, count)
            y.narrow(dim, start, r).add_(conv(strip, part, None, geometry.stride, geometry.strip_padding(), geometry.dilation, geometry.groups))
            strips.append(strip)
            boundaries.append((start, before))
        ctx.save_for_backward(local, weight, *strips)
        ctx.boundaries = tuple(boundaries)
        ctx.geometry, ctx.has_bias = geometry, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if creating_graph():  # a backward that autograd can differentiate again
            return _differentiable_backward(ctx, grad)
        local, weight, *strips = ctx.saved_tensors
        geometry: HaloConvGeometry = ctx.geometry
        dim, r = geometry.dim, geometry.reach
        need_input, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        pending = _exchange_rows(grad, geometry) if need_input else None
        grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad, local, weight, [weight.shape[0]] if ctx.has_bias else None,
            geometry.stride, geometry.padding, geometry.dilation, False, [0] * len(geometry.padding), geometry.groups,
            [need_input, need_weight, need_bias and ctx.has_bias],
        )
        kernel = weight.shape[dim]
        if need_weight:  # the halo rows' share of the weight gradient, in the kernel rows that reach them
            for strip, (start, before) in zip(strips, ctx.boundaries):
                first, count = geometry.reaching_rows(kernel, before)
                part = weight.narrow(dim, first, count)
                share = _conv_backward(grad.narrow(dim, start, r), strip, part, geometry, [False, True, False])[1]
                grad_weight.narrow(dim, first, count).add_(share)
        if need_input and ctx.boundaries:  # the neighbours' boundary outputs read r of our rows each
            prev_grad, next_grad = received_rows(pending, geometry.group)
            for neighbour_grad, (start, before) in zip((g for g in (prev_grad, next_grad) if g is not None), ctx.boundaries):
                # our first rows are the previous rank's halo after its slab, our last rows the next rank's halo before
                first, count = geometry.reaching_rows(kernel, not before)
                gap = geometry.strip_gap(count)
                strip = local.new_empty(with_extent(local.shape, dim, r + gap))
                strip_grad = _conv_backward(neighbour_grad, strip, weight.narrow(dim, first, count), geometry, [True, False, False])[0]
                grad_input.narrow(dim, start, r).add_(strip_grad.narrow(dim, gap if before else 0, r))
        return in_input_dtypes(ctx, grad_input, grad_weight, grad_bias)


def _differentiable_backward(ctx, grad: torch.Tensor) -> tuple:
    """The convolution re-run on the slab widened by its halo (window gather, whose backward is
    differentiable), differentiated with ``create_graph``."""

    def rerun(local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        geometry: HaloConvGeometry = ctx.geometry
        r = geometry.reach
        window = gather_window(local, geometry.dim, geometry.sizes, uniform_windows(geometry.sizes, r, r), group=geometry.group)
        conv = _CONV_BY_DIMS[local.ndim - 2]
        return conv(window, weight, None, geometry.stride, geometry.strip_padding(), geometry.dilation, geometry.groups)

    return differentiated_rerun(ctx, grad, rerun, "halo convolution")


def differentiated_rerun(ctx, grad: torch.Tensor, rerun: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], op: str) -> tuple:
    """A halo op's gradients as a differentiable function of its saved slab, weight and ``grad``, for a double backward.

    ``rerun(slab, weight)`` recomputes the op's output without bias from differentiable pieces;
    the bias gradient is a sum of ``grad``.
    """
    local, weight = ctx.saved_tensors[:2]
    input_dtype, weight_dtype, bias_dtype = ctx.dtypes
    if local.dtype != input_dtype or weight.dtype != weight_dtype:
        raise RuntimeError(
            f"{op}: cannot differentiate twice an op run under autocast (its saved inputs are the casts); run the "
            "double backward in full precision"
        )
    wanted = [t for t, need in zip((local, weight), ctx.needs_input_grad[:2]) if need]
    y = rerun(local, weight)
    grads = iter(torch.autograd.grad(y, wanted, grad, create_graph=True)) if wanted else iter(())
    grad_input = next(grads) if ctx.needs_input_grad[0] else None
    grad_weight = next(grads) if ctx.needs_input_grad[1] else None
    grad_bias = None
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.sum([d for d in range(grad.ndim) if d != 1]).to(bias_dtype)
    return grad_input, grad_weight, grad_bias, None


def in_input_dtypes(ctx, grad_input: torch.Tensor | None, grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None) -> tuple:
    """A halo op's backward result: each gradient in its input's dtype (the forward may have run on autocast casts)."""
    input_dtype, weight_dtype, bias_dtype = ctx.dtypes
    return (
        None if grad_input is None else grad_input.to(input_dtype),
        None if grad_weight is None else grad_weight.to(weight_dtype),
        None if grad_bias is None else grad_bias.to(bias_dtype),
        None,
    )


def autocast_inputs(local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """Under autocast, the conv's inputs in its compute dtype, as ``F.conv*`` would cast them."""
    device = local.device.type
    if not torch.is_autocast_enabled(device):
        return local, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return local.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def halo_conv(
    local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geometry: HaloConvGeometry
) -> torch.Tensor:
    """The 'same' convolution of the global tensor, on this rank's slab (see the module docstring)."""
    return _HaloConv.apply(local, weight, bias, geometry)


def eligible_geometry(
    sizes: Sequence[int],
    me: int,
    dim: int,
    dim_kernel: int,
    dim_stride: int,
    dim_dilation: int,
    dim_padding: tuple[int, int],
    **conv_args: Any,
) -> HaloConvGeometry | None:
    """The geometry when the sharded dim's conv is stride 1, zero 'same' padding and every shard holds its reach.

    ``dim_*`` describe the sharded dim; ``conv_args`` are the remaining geometry fields.
    """
    left, right = dim_padding
    reach = left
    span = dim_dilation * (dim_kernel - 1)
    if dim_stride != 1 or left != right or 2 * reach != span or reach == 0 or min(sizes) < reach:
        return None
    return HaloConvGeometry(dim=dim, reach=reach, sizes=tuple(sizes), has_prev=me > 0, has_next=me < len(sizes) - 1, **conv_args)
