"""The 'same'-padded convolution along one sharded dim, any stride, without copying the slab.

A convolution is linear in its input.  With zero padding ``p`` on both sides, ``2 p`` equal to the
kernel's span, and every rank's first row a multiple of the stride ``s``, torch's own op on the
slab alone (zero padded: the rank's data, no copy) yields exactly this rank's outputs (the ones
the general path assigns it: ``n / s`` per shard of ``n`` rows) except for what the neighbours'
rows add to a few boundary outputs:

- the previous rank's last ``p`` rows reach the first ``ceil(p / s)`` outputs;
- the next rank's first ``p - s + 1`` rows reach the last ``p // s`` (none for 3x3 stride 2).

The halo exchange starts first, the slab's convolution runs while it is in flight, then each
received halo is convolved, with only the kernel rows whose taps reach it (one row of a 3x3
kernel) and zeros for the slab's rows they also span, and added to the boundary outputs.  The
backward mirrors it: the output gradient's boundary rows travel to the neighbours while the
slab's ``convolution_backward`` runs (only the gradients autograd asks for), then the
neighbours' rows add their share to the boundary of the input gradient, and the halos add
theirs to those kernel rows' weight gradient.  A double backward (``create_graph=True``)
instead differentiates the same convolution written with the differentiable window gather
(:mod:`.halo`): slower, but only that case pays for it.

Eligible: zero padding ``p`` on both sides with ``2 p`` the kernel's span (``p = 0``: a kernel of
one row along the sharded dim, which needs no halo at all), one sharded spatial dim, every shard
but the last a multiple of the stride, and every shard at least ``max(p, 1)`` rows (halos come
from adjacent ranks only).  Everything else takes the general window-gather path in :mod:`.conv`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..shard_tensor import ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import differentiable_slab, input_gradient, slab_gradient, slab_of, taken_slab
from ._local import local_input, sharded_output, wrap_local_as
from .autocast import lower_precision
from .halo import gather_window, received_rows, start_edge_exchange, uniform_windows, with_extent
from .grad_sums import creating_graph

__all__ = ["HaloConvGeometry", "HaloStrip", "halo_conv", "differentiated_rerun", "in_input_dtypes", "saved_input"]

_CONV_BY_DIMS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class HaloStrip(NamedTuple):
    """One boundary's strip: ``zeros_before`` zero rows, ``rows`` halo rows, ``zeros_after`` zero rows
    (the zeros stand for slab rows, whose share the slab's own convolution has), convolved without
    padding along the sharded dim by kernel rows ``first_tap .. first_tap + taps`` into the
    ``outputs`` boundary outputs they reach.

    The halo's first row lies ``halo_start`` rows from the boundary: before a slab (``-p``), the
    previous rank's last rows; after it (``>= 0``), the next rank's first ones.
    """

    first_tap: int
    taps: int
    halo_start: int
    rows: int
    zeros_before: int
    zeros_after: int
    outputs: int


@dataclass(frozen=True)
class HaloConvGeometry:
    """Everything but the tensors and the process group: the sharded dim, what crosses each boundary, and
    the conv's own arguments (a pure function of the call's shapes, so :mod:`.conv` caches it)."""

    dim: int  # tensor dim of the sharded spatial dim
    kernel: int  # kernel extent along it
    padding: tuple[int, ...]  # per spatial dim, for the slab's own convolution
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    sizes: tuple[int, ...]  # the split of the sharded dim over its process group
    has_prev: bool
    has_next: bool

    def _along(self, values: tuple[int, ...]) -> int:
        return values[self.dim - 2]

    @property
    def reads_neighbours(self) -> bool:
        """Whether any output reads a neighbour's rows: not for a kernel of one row (``p = 0``)."""
        return self._along(self.padding) > 0

    def strip_padding(self) -> tuple[int, ...]:
        """The halo strips are convolved without padding along the sharded dim."""
        padding = list(self.padding)
        padding[self.dim - 2] = 0
        return tuple(padding)

    @cached_property
    def before(self) -> HaloStrip | None:
        """The previous rank's rows: output ``t`` reads local rows ``t s - p + k d``, the halo where
        negative; None for a kernel of one row (``p = 0``), which reads no neighbour's rows."""
        p, s, d = self._along(self.padding), self._along(self.stride), self._along(self.dilation)
        if p == 0:
            return None
        taps, outputs = -(-p // d), -(-p // s)  # the k with k d < p; the t with t s < p
        extent = (outputs - 1) * s + d * (taps - 1) + 1
        rows = min(p, extent)  # with stride > 1 the last halo rows may fall between taps
        return HaloStrip(0, taps, -p, rows, 0, extent - rows, outputs)

    @cached_property
    def after(self) -> HaloStrip | None:
        """The next rank's rows, reached by the last ``p // s`` outputs through kernel rows ``k d >= p + s``;
        None where none are (``p < s``)."""
        p, s, d = self._along(self.padding), self._along(self.stride), self._along(self.dilation)
        outputs = p // s
        if outputs == 0:
            return None
        first_tap = -(-(p + s) // d)
        extent = (outputs - 1) * s + d * (self.kernel - 1 - first_tap) + 1
        gap = outputs * s + p - first_tap * d  # strip rows before the halo (negative: halo rows skipped)
        return HaloStrip(first_tap, self.kernel - first_tap, max(-gap, 0), extent - max(gap, 0), max(gap, 0), 0, outputs)

    def strips(self, output_rows: int) -> list[tuple[HaloStrip, int, int]]:
        """(strip, neighbour's group rank offset, first output row it reaches) for each boundary with a neighbour."""
        before, after = self.before, self.after
        found = [(before, -1, 0)] if self.has_prev and before is not None else []
        if self.has_next and after is not None:
            found.append((after, 1, output_rows - after.outputs))
        return found


def _exchange_halos(local: torch.Tensor, geometry: HaloConvGeometry, group: ProcessGroup) -> collectives.PendingExchange:
    """Start sending this slab's rows that the neighbours' strips hold, and receiving ours."""
    dim = geometry.dim
    extent = local.shape[dim]
    before, after = geometry.before, geometry.after
    to_prev = local.narrow(dim, after.halo_start, after.rows) if geometry.has_prev and after is not None else None
    to_next = local.narrow(dim, extent + before.halo_start, before.rows) if geometry.has_next and before is not None else None
    from_prev = before.rows if geometry.has_prev and before is not None else 0
    from_next = after.rows if geometry.has_next and after is not None else 0
    return start_edge_exchange(to_prev, to_next, local.shape, from_prev, from_next, dim, group, local)


def _exchange_boundary_grads(grad: torch.Tensor, geometry: HaloConvGeometry, group: ProcessGroup) -> collectives.PendingExchange:
    """Start sending the gradient of our boundary outputs to the neighbours whose rows reached them, and receiving theirs."""
    dim = geometry.dim
    extent = grad.shape[dim]
    before, after = geometry.before, geometry.after
    before_outputs, after_outputs = (0 if strip is None else strip.outputs for strip in (before, after))
    to_prev = grad.narrow(dim, 0, before_outputs) if geometry.has_prev else None
    to_next = grad.narrow(dim, extent - after_outputs, after_outputs) if geometry.has_next else None
    from_prev = after_outputs if geometry.has_prev else 0
    from_next = before_outputs if geometry.has_next else 0
    return start_edge_exchange(to_prev, to_next, grad.shape, from_prev, from_next, dim, group, grad)


def _strip(halo: torch.Tensor, geometry: HaloConvGeometry, strip: HaloStrip) -> torch.Tensor:
    """The halo between the zero rows its strip needs (for a kernel of 3 rows, the halo alone)."""
    dim = geometry.dim
    pieces = [halo.new_zeros(with_extent(halo.shape, dim, strip.zeros_before))] if strip.zeros_before else []
    pieces.append(halo)
    if strip.zeros_after:
        pieces.append(halo.new_zeros(with_extent(halo.shape, dim, strip.zeros_after)))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _taps(weight: torch.Tensor, geometry: HaloConvGeometry, strip: HaloStrip) -> torch.Tensor:
    return weight.narrow(geometry.dim, strip.first_tap, strip.taps)


def _conv_backward(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, geometry: HaloConvGeometry, mask: list[bool]):
    """``convolution_backward`` of a halo strip (no padding along the sharded dim)."""
    return torch.ops.aten.convolution_backward(
        grad, input, weight, None, geometry.stride, geometry.strip_padding(), geometry.dilation, False,
        [0] * len(geometry.padding), geometry.groups, mask,
    )


class _HaloConv(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geometry: HaloConvGeometry,
        group: ProcessGroup, out_spec: ShardTensorSpec,
    ) -> ShardTensor:
        slab = taken_slab(ctx, input)
        conv = _CONV_BY_DIMS[slab.ndim - 2]
        dim = geometry.dim
        ctx.dtypes = (slab.dtype, weight.dtype, None if bias is None else bias.dtype)
        local, weight, bias = lower_precision(slab, weight, bias)  # the backward then sees one dtype
        pending = _exchange_halos(local, geometry, group)
        y = conv(local, weight, bias, geometry.stride, geometry.padding, geometry.dilation, geometry.groups)
        received = dict(zip((-1, 1), received_rows(pending, group)))
        strips = []
        for plan, side, first in geometry.strips(y.shape[dim]):
            strip = _strip(received[side], geometry, plan)
            part = _taps(weight, geometry, plan)
            y.narrow(dim, first, plan.outputs).add_(conv(strip, part, None, geometry.stride, geometry.strip_padding(), geometry.dilation, geometry.groups))
            strips.append(strip)
        ctx.save_for_backward(saved_input(input, slab, local), weight, *strips)
        ctx.geometry, ctx.group, ctx.has_bias = geometry, group, bias is not None
        return sharded_output(ctx, y, out_spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = slab_gradient(grad, ctx.out_spec)
        if creating_graph():  # a backward that autograd can differentiate again
            return _differentiable_backward(ctx, grad)
        saved, weight, *strips = ctx.saved_tensors
        local = slab_of(saved)
        geometry: HaloConvGeometry = ctx.geometry
        dim = geometry.dim
        extent = local.shape[dim]
        need_input, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        pending = _exchange_boundary_grads(grad, geometry, ctx.group) if need_input else None
        grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad, local, weight, [weight.shape[0]] if ctx.has_bias else None,
            geometry.stride, geometry.padding, geometry.dilation, False, [0] * len(geometry.padding), geometry.groups,
            [need_input, need_weight, need_bias and ctx.has_bias],
        )
        if need_weight:  # the halo rows' share of the weight gradient, in the kernel rows that reach them
            for strip, (plan, _, first) in zip(strips, geometry.strips(grad.shape[dim])):
                share = _conv_backward(grad.narrow(dim, first, plan.outputs), strip, _taps(weight, geometry, plan), geometry, [False, True, False])[1]
                _taps(grad_weight, geometry, plan).add_(share)
        if need_input:  # the neighbours' boundary outputs read some of our rows: their share of our gradient
            prev_grad, next_grad = received_rows(pending, ctx.group)
            # our first rows fed the previous rank's strip after its slab, our last rows the next rank's strip before it
            for neighbour_grad, plan, boundary in ((prev_grad, geometry.after, 0), (next_grad, geometry.before, extent)):
                if neighbour_grad is None:
                    continue
                first_row = boundary + plan.halo_start
                strip = local.new_empty(with_extent(local.shape, dim, plan.zeros_before + plan.rows + plan.zeros_after))
                strip_grad = _conv_backward(neighbour_grad, strip, _taps(weight, geometry, plan), geometry, [True, False, False])[0]
                grad_input.narrow(dim, first_row, plan.rows).add_(strip_grad.narrow(dim, plan.zeros_before, plan.rows))
        return in_input_dtypes(ctx, grad_input, grad_weight, grad_bias)


def _differentiable_backward(ctx, grad: torch.Tensor) -> tuple:
    """The convolution re-run on the slab widened by its halo (window gather, whose backward is
    differentiable), differentiated with ``create_graph``."""

    def rerun(local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        geometry: HaloConvGeometry = ctx.geometry
        p = geometry._along(geometry.padding)
        window = gather_window(local, geometry.dim, geometry.sizes, uniform_windows(geometry.sizes, p, p), group=ctx.group)
        conv = _CONV_BY_DIMS[local.ndim - 2]
        y = conv(window, weight, None, geometry.stride, geometry.strip_padding(), geometry.dilation, geometry.groups)
        return y.narrow(geometry.dim, 0, grad.shape[geometry.dim])

    return differentiated_rerun(ctx, grad, rerun, "halo convolution")


def differentiated_rerun(ctx, grad: torch.Tensor, rerun: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], op: str) -> tuple:
    """A halo op's gradients as a differentiable function of its saved input, weight and ``grad``, for a double backward.

    ``rerun(slab, weight)`` recomputes the op's output without bias from differentiable pieces;
    the bias gradient is a sum of ``grad``.
    """
    saved, weight = ctx.saved_tensors[:2]
    input_dtype, weight_dtype, bias_dtype = ctx.dtypes
    if saved.dtype != input_dtype or weight.dtype != weight_dtype:
        raise RuntimeError(
            f"{op}: cannot differentiate twice an op run under autocast (its saved inputs are the casts); run the "
            "double backward in full precision"
        )
    wanted = [t for t, need in zip((saved, weight), ctx.needs_input_grad[:2]) if need]
    y = rerun(differentiable_slab(saved), weight)
    grads = iter(torch.autograd.grad(y, wanted, grad, create_graph=True)) if wanted else iter(())
    grad_input = next(grads) if ctx.needs_input_grad[0] else None
    grad_weight = next(grads) if ctx.needs_input_grad[1] else None
    grad_bias = None
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.sum([d for d in range(grad.ndim) if d != 1]).to(bias_dtype)
    return grad_input, grad_weight, grad_bias, None, None, None


def saved_input(input: torch.Tensor, slab: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """What a halo op saves of its ``input`` (read as ``slab``, computed on as ``local``): the input
    itself, a ShardTensor whose slab a double backward takes again differentiably, unless autocast
    cast the slab (then the cast: a double backward refuses it)."""
    return input if local is slab else local


def in_input_dtypes(ctx, grad_input: torch.Tensor | None, grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None) -> tuple:
    """A halo op's backward result: each gradient in its input's dtype (the forward may have run on autocast casts)."""
    input_dtype, weight_dtype, bias_dtype = ctx.dtypes
    return (
        None if grad_input is None else input_gradient(ctx, grad_input.to(input_dtype)),
        None if grad_weight is None else grad_weight.to(weight_dtype),
        None if grad_bias is None else grad_bias.to(bias_dtype),
        None,
        None,
        None,
    )


def halo_conv(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geometry: HaloConvGeometry, group: ProcessGroup,
    out_spec: ShardTensorSpec,
) -> ShardTensor:
    """The 'same' convolution of the global tensor, on this rank's slab (see the module docstring), as
    the ShardTensor of ``out_spec``; ``group`` is the process group that splits ``geometry.dim``;
    ``input``: the ShardTensor itself (``conversions.function_input``) or its slab.

    A kernel of one row along it reads no neighbour's rows: torch's own op on the slab, under
    torch's autograd (through the Function a sharded 1x1 convolution's forward took 372 us with cold
    caches, now 176; torch's op alone 40-53).
    """
    if not geometry.reads_neighbours:
        local = local_input(input) if isinstance(input, ShardTensor) else input
        conv = _CONV_BY_DIMS[local.ndim - 2]
        return wrap_local_as(conv(local, weight, bias, geometry.stride, geometry.padding, geometry.dilation, geometry.groups), out_spec)
    return _HaloConv.apply(input, weight, bias, geometry, group, out_spec)


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
    """The geometry when the sharded dim's conv has zero 'same' padding, every shard but the last is a
    multiple of the stride (each rank's outputs start at its first row / stride) and every shard
    holds the ``p`` rows a neighbour needs.

    ``dim_*`` describe the sharded dim; ``conv_args`` are the remaining geometry fields.
    """
    left, right = dim_padding
    span = dim_dilation * (dim_kernel - 1)
    if left != right or 2 * left != span or min(sizes) < max(left, 1):
        return None
    if any(size % dim_stride for size in sizes[:-1]):
        return None
    return HaloConvGeometry(
        dim=dim, kernel=dim_kernel, sizes=tuple(sizes), has_prev=me > 0, has_next=me < len(sizes) - 1, **conv_args
    )
