"""The upsampling transposed convolution along one sharded dim, without copying the slab.

When the output is exactly ``stride`` times the input along the sharded dim and each rank's
outputs start at ``stride`` times its first input row (``dilation * (kernel - 1) // 2 ==
padding``: 4x4 stride 2 padding 1, 2x2 stride 2, 3x3 stride 2 padding 1 output padding 1),
torch's own transposed convolution of the slab alone, with the call's padding, yields exactly
this rank's output rows, short only of what the neighbours' boundary input rows add:

- the previous rank's last ``r_prev`` rows reach this rank's first ``q`` outputs;
- the next rank's first ``r_next`` rows reach its last ``padding`` outputs.

So the halo exchange starts, the slab's transposed convolution runs while it is in flight, then
each received halo's own transposed convolution (a few rows) adds the rows that land here.  The
backward mirrors it: the output gradient's boundary rows (``padding`` to the next rank, ``q`` to
the previous one) travel while the slab's ``convolution_backward`` runs, for only the gradients
autograd asks for; then the neighbours' gradient rows add their share to the boundary input
rows, and the halos theirs to the weight gradient.  A double backward differentiates the same
op written with the window gather (:mod:`.halo`).  Every other transposed convolution takes
the general window-gather path of :mod:`.conv`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..shard_tensor import ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import slab_gradient, slab_of, taken_slab
from .grad_sums import creating_graph
from .halo import exchange_boundary_rows, gather_window, received_rows, uniform_windows, with_extent
from .autocast import lower_precision
from ._local import sharded_output
from .halo_conv import differentiated_rerun, in_input_dtypes, saved_input

__all__ = ["TransposedHaloGeometry", "eligible_transposed_geometry", "halo_conv_transpose"]

_CONV_TRANSPOSE_BY_DIMS = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class TransposedHaloGeometry:
    """Everything but the tensors and the process group: the sharded dim, what crosses each boundary, and
    the op's own arguments (a pure function of the call's shapes, so :mod:`.conv` caches it)."""

    dim: int  # tensor dim of the sharded spatial dim
    kernel: int  # kernel extent along it
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    output_padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    sizes: tuple[int, ...]  # the input split of the sharded dim over its process group
    has_prev: bool
    has_next: bool

    def _along(self, values: tuple[int, ...]) -> int:
        return values[self.dim - 2]

    @property
    def span(self) -> int:
        return self._along(self.dilation) * (self.kernel - 1)

    @property
    def rows_before(self) -> int:
        """r_prev: the previous rank's input rows whose taps land in this rank's outputs."""
        return max(0, (self.span - self._along(self.padding)) // self._along(self.stride))

    @property
    def rows_after(self) -> int:
        """r_next: the next rank's input rows whose taps land in this rank's outputs."""
        stride = self._along(self.stride)
        return (self._along(self.padding) + stride - 1) // stride

    @property
    def reached_first(self) -> int:
        """q: this rank's first outputs that the previous rank's inputs reach."""
        return max(0, self.span - self._along(self.padding) - self._along(self.stride) + 1)

    @property
    def reached_last(self) -> int:
        """This rank's last outputs that the next rank's inputs reach (the padding)."""
        return self._along(self.padding)

    def strip_args(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(padding, output_padding) for a halo's own transposed convolution: none along the sharded dim."""
        padding, output_padding = list(self.padding), list(self.output_padding)
        padding[self.dim - 2] = output_padding[self.dim - 2] = 0
        return tuple(padding), tuple(output_padding)

    def before_window(self) -> tuple[int, int, int]:
        """(input rows, first output row used, output rows used) of a halo before a slab, in its strip."""
        rows = self.rows_before
        return rows, rows * self._along(self.stride) + self._along(self.padding), self.reached_first

    def after_window(self) -> tuple[int, int, int]:
        """The same for a halo after a slab: its strip's first ``padding`` rows."""
        return self.rows_after, 0, self.reached_last

    def strip_taps(self, window: tuple[int, int, int]) -> StripTaps:
        """The kernel taps along the sharded dim that carry a halo's rows into the window's used rows, and the rows they reach.

        Every other tap only writes strip rows that are cut away, so a halo's transposed convolution
        needs only these: for 4x4 stride 2 padding 1, one tap of four, whose output is just the used row.
        """
        rows, first, count = window
        stride, dilation = self._along(self.stride), self._along(self.dilation)
        hits = [(tap, out) for tap in range(self.kernel) for row in range(rows) if first <= (out := row * stride + tap * dilation) < first + count]
        taps, reached = [tap for tap, _ in hits], [out for _, out in hits]
        tap = min(taps)
        return StripTaps(tap, max(taps) - tap + 1, min(reached) - first, max(reached) - min(reached) + 1, min(reached) - tap * dilation)


class StripTaps(NamedTuple):
    """A halo's share of the output, computed from the kernel taps that reach the used rows only."""

    tap: int  # the first of them along the sharded dim
    taps: int  # how many, from ``tap`` on
    offset: int  # the first row they reach, counted from the window's first used row
    rows: int  # the rows they reach (the window's other rows get nothing from this halo)
    strip_row: int  # where that first row lies in the output of the halo's convolution with these taps


def eligible_transposed_geometry(
    sizes: Sequence[int], me: int, dim: int, kernel: int, out_extent: int, **op_args: Any
) -> TransposedHaloGeometry | None:
    """The geometry when the op upsamples the sharded dim exactly by its stride and every shard holds its halos."""
    geometry = TransposedHaloGeometry(
        dim=dim, kernel=kernel, sizes=tuple(sizes), has_prev=me > 0, has_next=me < len(sizes) - 1, **op_args
    )
    stride, padding = geometry._along(geometry.stride), geometry._along(geometry.padding)
    if geometry.span // 2 != padding or out_extent != stride * sum(sizes):
        return None  # the output split would not be stride x the input split
    smallest = min(sizes)
    if smallest < max(1, geometry.rows_before, geometry.rows_after):
        return None
    if stride * smallest < max(geometry.reached_first, geometry.reached_last):
        return None
    return geometry


def _strip_output(halo: torch.Tensor, weight: torch.Tensor, geometry: TransposedHaloGeometry, taps: StripTaps) -> torch.Tensor:
    """The rows of a halo's transposed convolution that land in this rank's outputs, from the taps that reach them."""
    padding, output_padding = geometry.strip_args()
    conv = _CONV_TRANSPOSE_BY_DIMS[halo.ndim - 2]
    kernel = weight.narrow(geometry.dim, taps.tap, taps.taps)
    out = conv(halo, kernel, None, geometry.stride, padding, output_padding, geometry.groups, geometry.dilation)
    return out.narrow(geometry.dim, taps.strip_row, taps.rows)


def _strip_backward(
    grad_rows: torch.Tensor, strip_input: torch.Tensor, weight: torch.Tensor, geometry: TransposedHaloGeometry,
    taps: StripTaps, mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``convolution_backward`` of :func:`_strip_output` from the gradient of the rows it reaches: the
    halo's input gradient, and the gradient of the taps it used."""
    dim, dilation = geometry.dim, geometry._along(geometry.dilation)
    extent = (strip_input.shape[dim] - 1) * geometry._along(geometry.stride) + (taps.taps - 1) * dilation + 1
    grad = grad_rows
    if (taps.strip_row, taps.rows) != (0, extent):  # the reached rows are part of the strip: zeros elsewhere
        grad = grad_rows.new_zeros(with_extent(grad_rows.shape, dim, extent))
        grad.narrow(dim, taps.strip_row, taps.rows).copy_(grad_rows)
    padding, output_padding = geometry.strip_args()
    grad_input, grad_weight, _ = torch.ops.aten.convolution_backward(
        grad, strip_input, weight.narrow(dim, taps.tap, taps.taps), None, geometry.stride, padding, geometry.dilation,
        True, output_padding, geometry.groups, mask,
    )
    return grad_input, grad_weight


class _HaloConvTranspose(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geometry: TransposedHaloGeometry,
        group: ProcessGroup, out_spec: ShardTensorSpec,
    ) -> ShardTensor:
        slab = taken_slab(ctx, input)
        ctx.dtypes = (slab.dtype, weight.dtype, None if bias is None else bias.dtype)
        local, weight, bias = lower_precision(slab, weight, bias)  # the backward then sees one dtype
        dim, before, after = geometry.dim, geometry.before_window(), geometry.after_window()
        from_prev, from_next = before[0] * geometry.has_prev, after[0] * geometry.has_next
        pending = exchange_boundary_rows(local, dim, group, after[0] * geometry.has_prev, before[0] * geometry.has_next, from_prev, from_next)
        conv = _CONV_TRANSPOSE_BY_DIMS[local.ndim - 2]
        y = conv(local, weight, bias, geometry.stride, geometry.padding, geometry.output_padding, geometry.groups, geometry.dilation)
        prev_rows, next_rows = received_rows(pending, group)
        halos = []  # (halo, its window, first output row it adds to)
        if prev_rows is not None and before[2]:
            halos.append((prev_rows, before, 0))
        if next_rows is not None and after[2]:
            halos.append((next_rows, after, y.shape[dim] - after[2]))
        for halo, window, start in halos:
            taps = geometry.strip_taps(window)
            y.narrow(dim, start + taps.offset, taps.rows).add_(_strip_output(halo, weight, geometry, taps))
        ctx.save_for_backward(saved_input(input, slab, local), weight, *(halo for halo, _, _ in halos))
        ctx.placements = tuple((window, start) for _, window, start in halos)
        ctx.geometry, ctx.group, ctx.has_bias = geometry, group, bias is not None
        return sharded_output(ctx, y, out_spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = slab_gradient(grad, ctx.out_spec)
        if creating_graph():  # a backward that autograd can differentiate again
            return _differentiable_backward(ctx, grad)
        saved, weight, *halos = ctx.saved_tensors
        local = slab_of(saved)
        geometry: TransposedHaloGeometry = ctx.geometry
        dim, before, after = geometry.dim, geometry.before_window(), geometry.after_window()
        need_input, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        pending = None
        if need_input:  # our first outputs read the previous rank's last inputs, our last ones the next rank's first
            to_prev, to_next = before[2] * geometry.has_prev, after[2] * geometry.has_next
            pending = exchange_boundary_rows(grad, dim, ctx.group, to_prev, to_next, after[2] * geometry.has_prev, before[2] * geometry.has_next)
        grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad, local, weight, [weight.shape[0]] if ctx.has_bias else None, geometry.stride, geometry.padding,
            geometry.dilation, True, geometry.output_padding, geometry.groups,
            [need_input, need_weight, need_bias and ctx.has_bias],
        )
        if need_weight:  # the halos' share of the weight gradient
            for halo, (window, start) in zip(halos, ctx.placements):
                taps = geometry.strip_taps(window)
                grad_rows = grad.narrow(dim, start + taps.offset, taps.rows)
                share = _strip_backward(grad_rows, halo, weight, geometry, taps, [False, True, False])[1]
                grad_weight.narrow(dim, taps.tap, taps.taps).add_(share)
        if need_input:
            prev_grad, next_grad = received_rows(pending, ctx.group)
            # the previous rank's last outputs read our first rows as its halo after; the next rank's first, our last as its halo before
            for neighbour_grad, window, start in ((prev_grad, after, 0), (next_grad, before, local.shape[dim] - before[0])):
                if neighbour_grad is None:
                    continue
                strip = local.new_empty(with_extent(local.shape, dim, window[0]))
                taps = geometry.strip_taps(window)
                grad_rows = neighbour_grad.narrow(dim, taps.offset, taps.rows)
                share = _strip_backward(grad_rows, strip, weight, geometry, taps, [True, False, False])[0]
                grad_input.narrow(dim, start, window[0]).add_(share)
        return in_input_dtypes(ctx, grad_input, grad_weight, grad_bias)


def _differentiable_backward(ctx, grad: torch.Tensor) -> tuple:
    """The op re-run on the slab widened by its halos (window gather, differentiable), without padding
    along the sharded dim, with this rank's output rows cut out, differentiated with ``create_graph``."""

    def rerun(local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        geometry: TransposedHaloGeometry = ctx.geometry
        dim, rows_before = geometry.dim, geometry.rows_before
        windows = uniform_windows(geometry.sizes, rows_before, geometry.rows_after)
        window = gather_window(local, dim, geometry.sizes, windows, group=ctx.group)
        padding, _ = geometry.strip_args()
        conv = _CONV_TRANSPOSE_BY_DIMS[local.ndim - 2]
        y = conv(window, weight, None, geometry.stride, padding, geometry.output_padding, geometry.groups, geometry.dilation)
        first = rows_before * geometry._along(geometry.stride) + geometry._along(geometry.padding)
        return y.narrow(dim, first, grad.shape[dim])

    return differentiated_rerun(ctx, grad, rerun, "halo transposed convolution")


def halo_conv_transpose(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geometry: TransposedHaloGeometry,
    group: ProcessGroup, out_spec: ShardTensorSpec,
) -> ShardTensor:
    """The transposed convolution of the global tensor, on this rank's slab (see the module docstring),
    as the ShardTensor of ``out_spec``; ``group`` is the process group that splits ``geometry.dim``;
    ``input``: the ShardTensor itself (``conversions.function_input``) or its slab."""
    return _HaloConvTranspose.apply(input, weight, bias, geometry, group, out_spec)
