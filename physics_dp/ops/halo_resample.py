"""torch's own resize kernel on the slab, along one sharded dim, without copying the slab.

With an integer power-of-two factor ``k`` and ``align_corners`` off, the rank owning input rows
``[lo, hi)`` owns output rows ``[k lo, k hi)``, and torch's kernel run on the slab alone computes
every one of them exactly as on the whole grid except a few border rows, whose taps reach the
neighbours' rows (bilinear x2: one row on each side).  So the slab is resized as it is, while the
halo rows travel; then each border is resized again from a small window (the neighbour's halo
rows and a few of the slab's) and written over the wrong rows.  The backward is linear too: the
slab's resize backward of the whole output gradient, minus what its border rows gave the slab
alone (a small backward), plus what they give the small windows, whose halo rows' gradients go
back to their owners.  Nothing the size of the slab or the output is copied, in either direction.

A double backward (``create_graph=True``) differentiates the same resize written with the
differentiable window gather (:mod:`.halo`) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..shard_tensor import ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import input_gradient, slab_gradient, taken_slab
from ._local import sharded_output
from .grad_sums import creating_graph
from .halo import exchange_boundary_rows, gather_window, received_rows, start_edge_exchange, with_extent
from .indexing import offsets

__all__ = ["BorderPlan", "ResampleGeometry", "halo_resample"]

_LINEAR_BACKWARD = {1: "upsample_linear1d_backward", 2: "upsample_bilinear2d_backward", 3: "upsample_trilinear3d_backward"}


@dataclass(frozen=True)
class BorderPlan:
    """One rank's borders along the sharded dim, as counts of rows (0 where it has no neighbour).

    ``wrong``: output rows at (top, bottom) that the slab alone gets wrong; ``halo``: rows needed
    from the (previous, next) rank; ``inner``: slab rows the border outputs' taps span.
    """

    wrong: tuple[int, int]
    halo: tuple[int, int]
    inner: tuple[int, int]


@dataclass(frozen=True)
class ResampleGeometry:
    """Everything but the tensors and the process group: the sharded dim, torch's resize arguments,
    every rank's borders (a pure function of the call's shapes, so the handler caches it)."""

    dim: int
    mode: str
    factors: tuple[int, ...]  # per spatial dim: integer powers of two
    sizes: tuple[int, ...]  # the split of the sharded dim over its process group
    me: int
    borders: tuple[BorderPlan, ...]  # per rank of the group

    @property
    def mine(self) -> BorderPlan:
        return self.borders[self.me]


def _resize(t: torch.Tensor, geometry: ResampleGeometry) -> torch.Tensor:
    return F.interpolate(t, scale_factor=[float(k) for k in geometry.factors], mode=geometry.mode)


def _resize_backward(grad: torch.Tensor, input_shape: Sequence[int], geometry: ResampleGeometry) -> torch.Tensor:
    """The gradient of :func:`_resize` for an input of ``input_shape``: torch's own backward kernel."""
    nd = len(input_shape) - 2
    scales = [float(k) for k in geometry.factors]
    out_size, in_size = list(grad.shape[2:]), list(input_shape)
    aten = torch.ops.aten
    if geometry.mode == "nearest":
        return getattr(aten, f"upsample_nearest{nd}d_backward")(grad, out_size, in_size, *scales)
    if geometry.mode == "nearest-exact":
        return getattr(aten, f"_upsample_nearest_exact{nd}d_backward")(grad, out_size, in_size, *scales)
    name = "upsample_bicubic2d_backward" if geometry.mode == "bicubic" else _LINEAR_BACKWARD[nd]
    return getattr(aten, name)(grad, out_size, in_size, False, *scales)


def _taken_by_neighbours(geometry: ResampleGeometry) -> tuple[int, int]:
    """How many of this rank's first and last rows the previous and next rank's border windows read."""
    me, borders = geometry.me, geometry.borders
    first = borders[me - 1].halo[1] if me > 0 else 0
    last = borders[me + 1].halo[0] if me < len(borders) - 1 else 0
    return first, last


class _HaloResample(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, input: torch.Tensor, geometry: ResampleGeometry, group: ProcessGroup, out_spec: ShardTensorSpec
    ) -> ShardTensor:
        local = taken_slab(ctx, input)
        dim, plan = geometry.dim, geometry.mine
        extent = local.shape[dim]
        first, last = _taken_by_neighbours(geometry)
        pending = exchange_boundary_rows(local, dim, group, first, last, *plan.halo)
        y = _resize(local, geometry)
        from_prev, from_next = received_rows(pending, group)
        k = geometry.factors[dim - 2]
        (top, bottom), halo_top, (inner_top, inner_bottom) = plan.wrong, plan.halo[0], plan.inner
        if top:
            window = torch.cat([from_prev, local.narrow(dim, 0, inner_top)], dim)
            y.narrow(dim, 0, top).copy_(_resize(window, geometry).narrow(dim, k * halo_top, top))
        if bottom:
            window = torch.cat([local.narrow(dim, extent - inner_bottom, inner_bottom), from_next], dim)
            y.narrow(dim, y.shape[dim] - bottom, bottom).copy_(_resize(window, geometry).narrow(dim, k * inner_bottom - bottom, bottom))
        ctx.geometry, ctx.group, ctx.input_shape = geometry, group, local.shape
        return sharded_output(ctx, y, out_spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = slab_gradient(grad, ctx.out_spec)
        geometry: ResampleGeometry = ctx.geometry
        shape = ctx.input_shape
        if creating_graph():
            return input_gradient(ctx, _differentiable_backward(shape, grad, geometry, ctx.group)), None, None, None
        dim, plan = geometry.dim, geometry.mine
        extent, out_extent = shape[dim], grad.shape[dim]
        (top, bottom), (halo_top, halo_bottom), (inner_top, inner_bottom) = plan.wrong, plan.halo, plan.inner
        # the borders first (small): their halo rows' gradients travel during the slab's backward
        top_fix = _border_backward(grad.narrow(dim, 0, top), shape, geometry, inner_top, halo_top, True) if top else None
        bottom_fix = (
            _border_backward(grad.narrow(dim, out_extent - bottom, bottom), shape, geometry, inner_bottom, halo_bottom, False)
            if bottom else None
        )
        receive = _taken_by_neighbours(geometry)  # the gradients of those rows come back
        pending = start_edge_exchange(
            None if top_fix is None else top_fix[1], None if bottom_fix is None else bottom_fix[1], shape, *receive, dim,
            ctx.group, grad,
        )
        grad_input = _resize_backward(grad, shape, geometry)
        if top_fix is not None:
            grad_input.narrow(dim, 0, inner_top).add_(top_fix[0])
        if bottom_fix is not None:
            grad_input.narrow(dim, extent - inner_bottom, inner_bottom).add_(bottom_fix[0])
        from_prev, from_next = received_rows(pending, ctx.group)
        if from_prev is not None:
            grad_input.narrow(dim, 0, receive[0]).add_(from_prev)
        if from_next is not None:
            grad_input.narrow(dim, extent - receive[1], receive[1]).add_(from_next)
        return input_gradient(ctx, grad_input), None, None, None


def _border_backward(
    border_grad: torch.Tensor, input_shape: Sequence[int], geometry: ResampleGeometry, inner: int, halo: int, top: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """For one border's overwritten output rows: (the correction of the ``inner`` slab rows'
    gradient, the gradient of the neighbour's ``halo`` rows).

    The slab's own backward credits the border rows' gradient to the slab alone; the correction
    takes that share back (a backward of the ``inner`` rows' resize) and adds the window's.
    """
    dim, k = geometry.dim, geometry.factors[geometry.dim - 2]
    count = border_grad.shape[dim]

    def spread(rows: int, offset: int) -> torch.Tensor:
        """The backward of a resize of ``rows`` input rows, whose output gradient is the border's at ``offset``."""
        out_grad = border_grad.new_zeros(with_extent(border_grad.shape, dim, k * rows))
        out_grad.narrow(dim, offset, count).copy_(border_grad)
        return _resize_backward(out_grad, with_extent(input_shape, dim, rows), geometry)

    slab_share = spread(inner, 0 if top else k * inner - count)
    window_share = spread(halo + inner, k * halo if top else k * inner - count)
    correction = window_share.narrow(dim, halo if top else 0, inner) - slab_share
    return correction, window_share.narrow(dim, 0 if top else inner, halo).contiguous()


def _differentiable_backward(shape: torch.Size, grad: torch.Tensor, geometry: ResampleGeometry, group: ProcessGroup) -> torch.Tensor:
    """The input gradient as a differentiable function of ``grad``: the resize of the gathered window.

    A resize is linear, so its backward does not depend on the input's values: any slab will do.
    """
    dim, k = geometry.dim, geometry.factors[geometry.dim - 2]
    windows = [
        (start - plan.halo[0], start + size + plan.halo[1])
        for start, size, plan in zip(offsets(geometry.sizes), geometry.sizes, geometry.borders)
    ]
    with torch.enable_grad():
        source = grad.new_zeros(shape).requires_grad_(True)
        window = gather_window(source, dim, geometry.sizes, windows, group=group)
        y = _resize(window, geometry).narrow(dim, k * geometry.mine.halo[0], k * shape[dim])
        (grad_input,) = torch.autograd.grad(y, source, grad, create_graph=True)
    return grad_input


def halo_resample(input: torch.Tensor, geometry: ResampleGeometry, group: ProcessGroup, out_spec: ShardTensorSpec) -> ShardTensor:
    """torch's resize of the global tensor, this rank's output rows, from its slab (see the module
    docstring), as the ShardTensor of ``out_spec``; ``group`` is the process group that splits ``geometry.dim``;
    ``input``: the ShardTensor itself (``conversions.function_input``) or its slab."""
    return _HaloResample.apply(input, geometry, group, out_spec)
