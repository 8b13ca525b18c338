"""``F.unfold`` and ``F.fold`` of a 'same' stencil along one sharded dim, without copying the slab.

With stride 1 and zero padding ``p = dilation * (kernel - 1) / 2`` along the sharded dim, a rank's
output positions are its own rows (the split the general path in :mod:`.unfold` gives it), and
torch's im2col with that padding, run on the slab alone, yields every position but the first and
last ``p``: those read the neighbours' rows, for which the zero padding stood in.  They are
recomputed from a strip of ``3 p`` rows (the neighbour's ``p`` and the slab's ``2 p`` nearest) and
written over.  So the slab is read once, as on one device, where the general path first copies it
twice (the window with its halo, then the zero padding).

fold (col2im) is unfold's adjoint, and each is the other's backward.  col2im with the padding, on
this rank's positions, drops what its boundary positions add to the rows beyond the slab; a strip
col2im of those positions computes that, it travels to the neighbour, who adds it to its edge rows.

Eligible (:func:`halo_unfold_geometry`): one mesh axis splits a spatial dim, stride 1 and 'same'
padding along it, and every shard at least ``max(2 p, 1)`` rows (a strip then lies within the rank
and one neighbour).  Everything else takes the general path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..shard_tensor.conversions import input_gradient, slab_gradient, taken_slab
from ..shard_tensor.spec import ShardTensorSpec
from ._local import sharded_output
from .halo import exchange_boundary_rows, received_rows, start_edge_exchange
from .pooling import Stencil

__all__ = ["HaloUnfoldGeometry", "halo_unfold_geometry", "halo_unfold", "halo_fold"]


@dataclass(frozen=True)
class HaloUnfoldGeometry:
    """The stencil per spatial dim, which of the two is sharded, and which neighbours this rank has."""

    sharded: int  # 0: the first spatial dim (H), 1: the second (W)
    kernel: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: tuple[int, ...]
    stride: tuple[int, ...]  # 1 along the sharded dim
    has_prev: bool
    has_next: bool

    @property
    def halo(self) -> int:
        """Rows a boundary position reaches beyond the slab: the padding along the sharded dim."""
        return self.padding[self.sharded]

    def strip_padding(self) -> tuple[int, ...]:
        """A strip holds its rows along the sharded dim: padding only along the other spatial dim."""
        return tuple(0 if i == self.sharded else p for i, p in enumerate(self.padding))

    def grid(self, extents: Sequence[int], padding: Sequence[int]) -> tuple[int, ...]:
        """Positions per spatial dim of an unfold of ``extents`` with this stencil and ``padding``."""
        return tuple(
            Stencil(k, step, pad, dil).positions(extent)
            for extent, k, step, pad, dil in zip(extents, self.kernel, self.stride, padding, self.dilation)
        )


def halo_unfold_geometry(
    sharded: int,
    sizes: Sequence[int],
    me: int,
    kernel: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    stride: Sequence[int],
) -> HaloUnfoldGeometry | None:
    """This rank's geometry (``sizes``: the split of spatial dim ``sharded``, ``me``: this rank's place
    in it; the stencil per spatial dim) where the path applies, else None."""
    k, d, p, s = kernel[sharded], dilation[sharded], padding[sharded], stride[sharded]
    if s != 1 or 2 * p != d * (k - 1) or min(sizes) < max(2 * p, 1):
        return None
    return HaloUnfoldGeometry(sharded, tuple(kernel), tuple(dilation), tuple(padding), tuple(stride), me > 0, me < len(sizes) - 1)


def _unfold_with_halos(local: torch.Tensor, geometry: HaloUnfoldGeometry, group: ProcessGroup) -> torch.Tensor:
    """This rank's positions (…, C K, ho wo): im2col of the slab, its boundary positions recomputed from strips."""
    dim, p = local.ndim - 2 + geometry.sharded, geometry.halo
    rows_prev, rows_next = p if geometry.has_prev else 0, p if geometry.has_next else 0
    pending = exchange_boundary_rows(local, dim, group, rows_prev, rows_next, rows_prev, rows_next) if p else None
    cols = F.unfold(local, geometry.kernel, geometry.dilation, geometry.padding, geometry.stride)
    if pending is None:
        return cols
    from_prev, from_next = received_rows(pending, group)
    positions = cols.unflatten(-1, geometry.grid(local.shape[-2:], geometry.padding))
    extent = local.shape[dim]
    if from_prev is not None:
        _rewrite_positions(positions, 0, torch.cat((from_prev, local.narrow(dim, 0, 2 * p)), dim), dim, geometry)
    if from_next is not None:
        _rewrite_positions(positions, extent - p, torch.cat((local.narrow(dim, extent - 2 * p, 2 * p), from_next), dim), dim, geometry)
    return cols


def _rewrite_positions(positions: torch.Tensor, first: int, strip: torch.Tensor, dim: int, geometry: HaloUnfoldGeometry) -> None:
    """Overwrite positions ``first .. first + p`` with the unfold of ``strip``: the 3 p rows their windows read."""
    padding = geometry.strip_padding()
    cols = F.unfold(strip, geometry.kernel, geometry.dilation, padding, geometry.stride)
    positions.narrow(dim, first, geometry.halo).copy_(cols.unflatten(-1, geometry.grid(strip.shape[-2:], padding)))


def _fold_with_halos(
    cols: torch.Tensor, extents: tuple[int, int], geometry: HaloUnfoldGeometry, group: ProcessGroup
) -> torch.Tensor:
    """col2im of this rank's positions into its rows (``extents``), with what the neighbours' boundary positions add to its edge rows.

    The neighbours' strips come first (small) and travel while the slab's col2im runs, as the other
    slab paths start their exchange before their kernel: what a neighbour sends leaves before its
    col2im, not after it."""
    def fold(positions: torch.Tensor, rows: Sequence[int], padding: tuple[int, ...]) -> torch.Tensor:
        return F.fold(positions, rows, geometry.kernel, geometry.dilation, padding, geometry.stride)

    p = geometry.halo
    if not p or not (geometry.has_prev or geometry.has_next):
        return fold(cols, extents, geometry.padding)
    dim = cols.ndim - 1 + geometry.sharded  # of the output and of the positions grid alike
    extent = extents[geometry.sharded]
    positions = cols.unflatten(-1, geometry.grid(extents, geometry.padding))
    strip_extents = list(extents)
    strip_extents[geometry.sharded] = 3 * p

    def beyond(first: int, keep: int) -> torch.Tensor:
        """What positions ``first .. first + p`` add to the ``p`` rows from strip row ``keep`` (outside the slab)."""
        return fold(positions.narrow(dim, first, p).flatten(-2), strip_extents, geometry.strip_padding()).narrow(dim, keep, p)

    to_prev = beyond(0, 0) if geometry.has_prev else None
    to_next = beyond(extent - p, 2 * p) if geometry.has_next else None
    count_prev, count_next = p if geometry.has_prev else 0, p if geometry.has_next else 0
    rows_shape = (to_prev if to_prev is not None else to_next).shape  # what each neighbour sends back: p rows alike
    pending = start_edge_exchange(to_prev, to_next, rows_shape, count_prev, count_next, dim, group, cols)
    out = fold(cols, extents, geometry.padding)
    from_prev, from_next = received_rows(pending, group)
    if from_prev is not None:
        out.narrow(dim, 0, p).add_(from_prev)
    if from_next is not None:
        out.narrow(dim, extent - p, p).add_(from_next)
    return out


class _HaloUnfold(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, input: torch.Tensor, geometry: HaloUnfoldGeometry, group: ProcessGroup, out_spec: ShardTensorSpec | None
    ) -> torch.Tensor:
        local = taken_slab(ctx, input)
        ctx.geometry, ctx.group, ctx.extents = geometry, group, tuple(local.shape[-2:])
        return _returned(ctx, _unfold_with_halos(local, geometry, group), out_spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = _slab_grad(ctx, grad)
        grad_input = _HaloFold.apply(grad.contiguous(), ctx.extents, ctx.geometry, ctx.group, None)
        return input_gradient(ctx, grad_input), None, None, None


class _HaloFold(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, cols: torch.Tensor, extents: tuple[int, int], geometry: HaloUnfoldGeometry, group: ProcessGroup,
        out_spec: ShardTensorSpec | None,
    ) -> torch.Tensor:
        ctx.geometry, ctx.group = geometry, group
        return _returned(ctx, _fold_with_halos(cols, extents, geometry, group), out_spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = _slab_grad(ctx, grad)
        return _HaloUnfold.apply(grad.contiguous(), ctx.geometry, ctx.group, None), None, None, None, None


def _returned(ctx, result: torch.Tensor, out_spec: ShardTensorSpec | None) -> torch.Tensor:
    """The Function's slab result, as the ShardTensor of ``out_spec`` where given (one autograd node per op,
    no conversion node after it); each Function's backward runs the other without one, on slabs."""
    ctx.wraps = out_spec is not None
    return sharded_output(ctx, result, out_spec) if ctx.wraps else result


def _slab_grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    return slab_gradient(grad, ctx.out_spec) if ctx.wraps else grad


def halo_unfold(
    input: torch.Tensor, geometry: HaloUnfoldGeometry, group: ProcessGroup, out_spec: ShardTensorSpec | None = None
) -> torch.Tensor:
    """``F.unfold`` of the global tensor, this rank's positions (…, C K, ho wo), from its slab (…, C, H, W)
    or the ShardTensor itself (``conversions.function_input``): the slab, or the ShardTensor of
    ``out_spec`` where given."""
    return _HaloUnfold.apply(input, geometry, group, out_spec)


def halo_fold(
    cols: torch.Tensor, extents: tuple[int, int], geometry: HaloUnfoldGeometry, group: ProcessGroup,
    out_spec: ShardTensorSpec | None = None,
) -> torch.Tensor:
    """``F.fold`` of the global positions, this rank's rows (…, C, ``extents``), from its positions (…, C K, ho wo):
    the slab, or the ShardTensor of ``out_spec`` where given."""
    return _HaloFold.apply(cols, extents, geometry, group, out_spec)
