"""``F.unfold`` (im2col) and ``F.fold`` (col2im) over sharded spatial dims, without gathering.

Unfold is a stencil like a pool: output position (i, j) holds the input window starting at
(i * stride - padding, j * stride - padding).  So each rank owns the positions a convolution of
the same geometry gives it (:func:`.conv.conv_output_split`), gathers the input rows their windows
read (:func:`.pooling.gather_inside`: a halo exchange, only rows inside the grid travel), fills the
padding with zeros locally and runs torch's unfold without padding.  It sends what a convolution
with that kernel sends; the backward sends the halo rows' gradients back to their owners.

The output (N, C * K, Ho * Wo) flattens two pairs of dims.  Its layout is the view planner's
(:func:`.views.view_spec_in_place`) for flattening (N, C, K, Ho, Wo) sharded like the input: a
contiguous ``Shard`` of the last dim where only Ho is split, a ``StridedShard`` (each rank's
Ho x Wo block, as ``flatten`` of a 2-D decomposition gives) where Wo is.  The slab is reshaped as
a plain tensor, not through dispatched views (four dispatches, with their backwards, cost about
as much as the exchanges); fold plans its input's unflatten the same way.  Without a sharded spatial dim each
rank unfolds its slab (batch shards; a channel shard stays a shard of C * K).

Fold is unfold's adjoint: it adds each position's window into the grid, and windows overlap
where stride < kernel.  Its input is viewed back as (N, C, K, Ho, Wo) (a ``Shard`` or the
``StridedShard`` above becomes shards of Ho and Wo); each rank folds its positions into the rows
their windows cover (torch's fold without padding), and :func:`.halo.scatter_window` sends each
row beyond the rank's own to its owner, who adds it: the halo exchange in reverse, as many
bytes.  A rank owns the rows from the centre of its first position's window on, so a fold of
an unfold's output gets back the unfold's split wherever the split's boundaries are window
centres (always at stride 1, and for patches (stride = kernel) cut at whole patches, which then
send nothing).

A 'same' stencil of stride 1 along the one split spatial dim (3 x 3 with padding 1, the usual case)
takes :mod:`.halo_unfold` instead, both ways: torch's im2col and col2im on the slab itself, with
strips for the boundary positions, so neither copies the slab.  Its plan (the geometry and the
output's layout) is made once per call signature (:mod:`.call_plans`): made at each call, it cost
0.13 ms of unfold's forward and 0.07 ms of fold's at (1, 16, 128, 128) on 2 ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..shard_tensor import Replicate, Shard, ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import function_input
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.fallback import propagate_and_run
from ._args import bind, per_dim, single_device_shape
from ._local import local_input, sharded_axes, wrap_local_as
from .call_plans import HaloPlan, PlanCache, hashable, layout_key
from .conv import check_stencil_layout, conv_output_split, conv_windows, window_inside
from .halo import Window, scatter_window
from .halo_unfold import HaloUnfoldGeometry, halo_fold, halo_unfold, halo_unfold_geometry
from .indexing import axis_splitting
from .pooling import DimSplit, Stencil, dim_split, drop_filler, fill_outside, gather_inside, output_axis_sizes, stencil_splits
from .views import view_spec_in_place

__all__: list[str] = []

_NAMES = ("input", "kernel_size", "dilation", "padding", "stride")
_FOLD_NAMES = ("input", "output_size", "kernel_size", "dilation", "padding", "stride")
_DEFAULTS = {"dilation": 1, "padding": 0, "stride": 1}


# ----- the 'same'-stencil paths, planned once per call signature (:mod:`.call_plans`) -----------
_HALO_PLANS = PlanCache()


def _cached_plan(func: Any, bound: dict[str, Any], build: Callable[[dict[str, Any]], HaloPlan | None]) -> HaloPlan | None:
    """The cached :mod:`.halo_unfold` plan of this call (None: the general path); a plain input takes
    the general path, whose checks name the problem."""
    x = bound["input"]
    if not isinstance(x, ShardTensor):
        return None
    key = (func, layout_key(x), *(hashable(value) for name, value in bound.items() if name != "input"))
    return _HALO_PLANS.plan(key, x.device_mesh, lambda: build(bound))


def _stencils(bound: dict[str, Any]) -> list[Stencil]:
    names = ("kernel_size", "stride", "padding", "dilation")
    return [Stencil(*params) for params in zip(*(per_dim(bound[name], 2) for name in names))]


def _unfold_local(local: torch.Tensor, x: ShardTensor, stencils: list[Stencil]) -> tuple[torch.Tensor, list]:
    """This rank's blocks (…, C * K, ho, wo) and the split of every mesh axis over (…, Ho, Wo)."""
    kernel = tuple(s.kernel for s in stencils)
    dilation, stride = tuple(s.dilation for s in stencils), tuple(s.stride for s in stencils)
    spatial = range(x.ndim - 2, x.ndim)
    if not any(dim in spatial for _, dim in sharded_axes(x)):
        cols = F.unfold(local, kernel, dilation, tuple(s.padding for s in stencils), stride)
        grid = tuple(s.positions(local.shape[d]) for d, s in zip(spatial, stencils))
        return cols.unflatten(-1, grid), list(x._spec.axis_sizes)
    halo = _halo_geometry(x._spec, stencils, x.ndim - 2)
    if halo is not None:  # a 'same' stencil along one split dim: no copy of the slab (:mod:`.halo_unfold`)
        geometry, axis = halo
        cols = halo_unfold(local, geometry, x.device_mesh.get_group(axis))
        return cols.unflatten(-1, geometry.grid(local.shape[-2:], geometry.padding)), list(x._spec.axis_sizes)
    out_grid = torch.Size((*x.shape[:-2], *(s.positions(x.shape[d]) for d, s in zip(spatial, stencils))))
    splits = stencil_splits(x, out_grid, stencils)
    window = fill_outside(gather_inside(local, x, splits), splits, stencils, 0.0)
    cols = F.unfold(window, kernel, dilation, 0, stride)
    grid = tuple((window.shape[d] - s.span) // s.stride + 1 for d, s in zip(spatial, stencils))
    return drop_filler(cols.unflatten(-1, grid), splits), output_axis_sizes(x, splits)


def _halo_geometry(spec: ShardTensorSpec, stencils: list[Stencil], first_spatial: int) -> tuple[HaloUnfoldGeometry, int] | None:
    """(geometry, mesh axis) where one mesh axis alone splits the spatial dims (tensor dims from
    ``first_spatial``) and :func:`.halo_unfold.halo_unfold_geometry` accepts the stencil, else None."""
    shards = [(axis, p.dim) for axis, p in enumerate(spec.placements) if type(p) is Shard and p.dim >= first_spatial]
    if len(shards) != 1:
        return None
    axis, dim = shards[0]
    kernel, dilation, padding, stride = (tuple(getattr(s, name) for s in stencils) for name in ("kernel", "dilation", "padding", "stride"))
    geometry = halo_unfold_geometry(dim - first_spatial, spec.axis_sizes[axis], spec.coordinate()[axis], kernel, dilation, padding, stride)
    return None if geometry is None else (geometry, axis)


def _unfold_specs(x: ShardTensor, stencils: list[Stencil], axis_sizes: list) -> tuple[ShardTensorSpec, ShardTensorSpec | None]:
    """The output's layout as (…, C, K, Ho, Wo) blocks, and as the flat (…, C * K, Ho * Wo) when
    flattening moves no rows (else None)."""
    channel = x.ndim - 3  # (N, C, H, W) or unbatched (C, H, W)
    taps = math.prod(s.kernel for s in stencils)
    grid = tuple(s.positions(x.shape[d]) for d, s in zip(range(x.ndim - 2, x.ndim), stencils))
    placements = [Shard(p.dim + (p.dim > channel)) if type(p) is Shard else p for p in x.placements]
    spec = ShardTensorSpec(x.device_mesh, placements, (*x.shape[: channel + 1], taps, *grid), axis_sizes)
    return spec, view_spec_in_place(spec, (*x.shape[:channel], x.shape[channel] * taps, math.prod(grid)))


def _unfold_stencils(bound: dict[str, Any]) -> list[Stencil]:
    """Check an unfold call (the input's layout, then torch's own errors for the arguments) and read its stencils."""
    check_stencil_layout("unfold", bound["input"], (), None)
    single_device_shape(F.unfold, bound)
    return _stencils(bound)


def _halo_unfold_plan(bound: dict[str, Any]) -> HaloPlan | None:
    """:mod:`.halo_unfold`'s path for this call, where it applies and its output is the flat layout."""
    x = bound["input"]
    stencils = _unfold_stencils(bound)
    halo = _halo_geometry(x._spec, stencils, x.ndim - 2)
    if halo is None:
        return None
    _, flat = _unfold_specs(x, stencils, list(x._spec.axis_sizes))
    return None if flat is None else HaloPlan(halo[0], halo[1], flat)


def _unfold(*args: Any, **kwargs: Any) -> ShardTensor:
    bound = bind(_NAMES, args, kwargs, _DEFAULTS)
    x = bound["input"]
    plan = _cached_plan(F.unfold, bound, _halo_unfold_plan)
    if plan is not None:
        return halo_unfold(function_input(x), plan.geometry, x.device_mesh.get_group(plan.axis), plan.out_spec)
    stencils = _unfold_stencils(bound)
    blocks, axis_sizes = _unfold_local(local_input(x), x, stencils)
    spec, flat = _unfold_specs(x, stencils, axis_sizes)
    if flat is not None:
        return wrap_local_as(blocks.flatten(-2), flat)
    channel = x.ndim - 3
    taps = spec.shape[channel + 1]
    blocks = blocks.unflatten(channel, (blocks.shape[channel] // taps, taps))
    return wrap_local_as(blocks, spec).flatten(channel, channel + 1).flatten(-2)


# ----- fold -------------------------------------------------------------------------------------
def _fold_windows(positions: tuple[int, ...], stencil: Stencil) -> tuple[Window, ...]:
    """Global rows each rank's positions write (one zero position's rows for a rank with none)."""
    windows, first = [], 0
    for count in positions:
        lo = first * stencil.stride - stencil.padding
        windows.append((lo, lo + (max(count, 1) - 1) * stencil.stride + stencil.span))
        first += count
    return tuple(windows)


def _owned_rows(positions: tuple[int, ...], stencil: Stencil, extent: int) -> tuple[int, ...]:
    """Rows each rank owns: from the centre of its first position's window to the next rank's."""
    bounds, first = [0], 0
    for count in positions[:-1]:
        first += count
        centre = first * stencil.stride - stencil.padding + (stencil.span - 1) // 2
        bounds.append(min(max(centre, bounds[-1]), extent))
    bounds.append(extent)
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _fold_locally(
    local: torch.Tensor, stencils: list[Stencil], extents: tuple[int, ...], windows: dict[int, tuple[Window, ...]], me: dict[int, int]
) -> torch.Tensor:
    """Fold this rank's (…, C, K, ho, wo) positions into the rows their windows cover: a sharded
    dim's window (``windows[i][me[i]]``, padding as rows beyond the grid), a whole dim's grid."""
    lead = local.ndim - 4
    sizes, pads = list(extents), [0, 0, 0, 0]
    for i, dim_windows in windows.items():
        lo, hi = dim_windows[me[i]]
        sizes[i] = hi - lo
        pads[3 - 2 * i] = int(local.shape[lead + 2 + i] == 0)  # one zero position: every rank runs the same graph
    local = F.pad(local, pads) if any(pads) else local
    padding = tuple(0 if i in windows else s.padding for i, s in enumerate(stencils))
    kernel, dilation, stride = (tuple(getattr(s, name) for s in stencils) for name in ("kernel", "dilation", "stride"))
    return F.fold(local.flatten(lead, lead + 1).flatten(-2), sizes, kernel, dilation, padding, stride)


class _FoldCall(NamedTuple):
    """What a fold call's arguments say: the stencils, the output's extents, the taps per
    position, the dims before C * K (1 with a batch dim) and the positions' grid."""

    stencils: list[Stencil]
    extents: tuple[int, ...]
    taps: int
    lead: int
    grid: tuple[int, ...]

    def blocks_shape(self, cols: ShardTensor) -> tuple[int, ...]:
        """The positions (…, C * K, Ho * Wo) as (…, C, K, Ho, Wo) blocks."""
        lead = self.lead
        return (*cols.shape[:lead], cols.shape[lead] // self.taps, self.taps, *self.grid)


def _fold_call(bound: dict[str, Any]) -> _FoldCall:
    """Check a fold call's arguments (torch's own errors) and read them."""
    cols = bound["input"]
    check_stencil_layout("fold", cols, (), None)
    single_device_shape(F.fold, bound)
    stencils, extents = _stencils(bound), per_dim(bound["output_size"], 2)
    grid = tuple(s.positions(e) for e, s in zip(extents, stencils))
    return _FoldCall(stencils, extents, math.prod(s.kernel for s in stencils), cols.ndim - 2, grid)


def _blocks_in_place(cols: ShardTensor, shape: tuple[int, ...]) -> ShardTensorSpec | None:
    """The layout of fold's positions viewed as (…, C, K, Ho, Wo) blocks where each rank's slab
    reshapes in place (no split of K inside a channel), else None."""
    lead = len(shape) - 4
    spec = view_spec_in_place(cols._spec, shape)
    if spec is None or any(type(p) is Shard and p.dim == lead + 1 for p in spec.placements):
        return None
    return spec


def _positions_as_blocks(cols: ShardTensor, call: _FoldCall) -> tuple[torch.Tensor, ShardTensorSpec]:
    """Fold's input (…, C * K, Ho * Wo) as this rank's (…, C, K, ho, wo) slab and its layout: the
    slab reshaped in place where the view moves no rows, else through the view handlers (and a
    C * K split that cuts a channel gathered)."""
    lead, shape = call.lead, call.blocks_shape(cols)
    spec = _blocks_in_place(cols, shape)
    if spec is not None:
        return local_input(cols).reshape(spec.local_shape()), spec
    blocks = cols.unflatten(-1, call.grid).unflatten(lead, shape[lead : lead + 2])
    if any(type(p) is Shard and p.dim == lead + 1 for p in blocks.placements):  # C * K split inside a channel
        blocks = blocks.redistribute(placements=[Replicate() if p == Shard(lead + 1) else p for p in blocks.placements])
    return local_input(blocks), blocks._spec


def _fold_out_spec(cols: ShardTensor, call: _FoldCall, spec: ShardTensorSpec, axis_sizes: list) -> ShardTensorSpec:
    """The folded output's layout: the blocks' placements with K gone, the rows' split ``axis_sizes``."""
    lead = call.lead
    placements = [Shard(p.dim - (p.dim > lead)) if type(p) is Shard else p for p in spec.placements]
    return ShardTensorSpec(spec.mesh, placements, (*cols.shape[:lead], cols.shape[lead] // call.taps, *call.extents), axis_sizes)


def _halo_fold_rows(call: _FoldCall, geometry: HaloUnfoldGeometry, blocks: tuple[int, ...]) -> tuple[int, ...]:
    """This rank's output extents: its positions' rows along the split dim (the rows' split is the positions')."""
    rows = list(call.extents)
    rows[geometry.sharded] = blocks[call.lead + 2 + geometry.sharded]
    return tuple(rows)


def _halo_fold_plan(bound: dict[str, Any]) -> HaloPlan | None:
    """:mod:`.halo_unfold`'s path for this call, where the positions reshape in place into blocks;
    the plan's geometry is (the stencil's geometry, the blocks' local shape, this rank's extents)."""
    cols = bound["input"]
    call = _fold_call(bound)
    spec = _blocks_in_place(cols, call.blocks_shape(cols))
    halo = None if spec is None else _halo_geometry(spec, call.stencils, call.lead + 2)
    if halo is None:
        return None
    geometry, axis = halo
    blocks = spec.local_shape()
    plan_geometry = (geometry, blocks, _halo_fold_rows(call, geometry, blocks))
    return HaloPlan(plan_geometry, axis, _fold_out_spec(cols, call, spec, list(spec.axis_sizes)))


def _fold(*args: Any, **kwargs: Any) -> ShardTensor:
    bound = bind(_FOLD_NAMES, args, kwargs, _DEFAULTS)
    cols = bound["input"]
    plan = _cached_plan(F.fold, bound, _halo_fold_plan)
    if plan is not None:
        (geometry, blocks, rows), lead = plan.geometry, cols.ndim - 2
        local = local_input(cols).reshape(blocks).flatten(lead, lead + 1).flatten(-2)
        return halo_fold(local, rows, geometry, cols.device_mesh.get_group(plan.axis), plan.out_spec)
    call = _fold_call(bound)
    local, spec = _positions_as_blocks(cols, call)
    halo = _halo_geometry(spec, call.stencils, call.lead + 2)
    if halo is not None:  # a 'same' stencil along one split dim, positions that needed the view handlers
        geometry, axis = halo
        flat = local.flatten(call.lead, call.lead + 1).flatten(-2)
        window = halo_fold(flat, _halo_fold_rows(call, geometry, tuple(local.shape)), geometry, spec.mesh.get_group(axis))
        axis_sizes = list(spec.axis_sizes)
    else:
        window, axis_sizes = _fold_through_windows(local, call.lead, call.stencils, call.extents, spec)
    return wrap_local_as(window, _fold_out_spec(cols, call, spec, axis_sizes))


def _fold_through_windows(
    local: torch.Tensor, lead: int, stencils: list[Stencil], extents: tuple[int, ...], spec: ShardTensorSpec
) -> tuple[torch.Tensor, list]:
    """Any geometry: fold into the rows the positions' windows cover, then send the rows beyond the
    rank's own to their owners.  (This rank's rows, the rows' split per mesh axis.)"""
    axis_of = {p.dim - lead - 2: axis for axis, p in enumerate(spec.placements) if type(p) is Shard and p.dim >= lead + 2}
    me = {i: spec.coordinate()[axis] for i, axis in axis_of.items()}
    windows = {i: _fold_windows(spec.axis_sizes[axis], stencils[i]) for i, axis in axis_of.items()}
    window = _fold_locally(local, stencils, extents, windows, me)
    inside: dict[int, tuple[Window, ...]] = {}
    for i, dim_windows in windows.items():  # rows beyond the grid are dropped: drop them first, so no exchange carries them
        inside[i] = tuple(window_inside(w, extents[i]) for w in dim_windows)
        (lo, _), (inside_lo, inside_hi) = dim_windows[me[i]], inside[i][me[i]]
        window = window.narrow(lead + 1 + i, inside_lo - lo, inside_hi - inside_lo)
    axis_sizes = list(spec.axis_sizes)
    for i in sorted(axis_of, key=axis_of.get, reverse=True):  # the adjoint of gathering in mesh-axis order
        axis = axis_of[i]
        axis_sizes[axis] = _owned_rows(spec.axis_sizes[axis], stencils[i], extents[i])
        window = scatter_window(window, lead + 1 + i, axis_sizes[axis], inside[i], group=spec.mesh.get_group(axis))
    return window, axis_sizes


# ----- Tensor.unfold: sliding windows along one dim --------------------------------------------
def _sliding_windows(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """``x.unfold(dim, size, step)`` over a sharded dim: each rank owns the windows a convolution of
    kernel ``size`` and stride ``step`` would give it, gathers the halo rows they reach (none for
    patches cut at the split's boundaries) and unfolds locally.  torch returns a view of ``x``;
    this result is a copy (its windows came partly from other ranks), so an in-place write to it
    does not reach ``x``."""
    bound = bind(("input", "dimension", "size", "step"), args, kwargs, {})
    x, dim, size, step = bound["input"], bound["dimension"], bound["size"], bound["step"]
    if not isinstance(x, ShardTensor) or not all(type(v) is int for v in (dim, size, step)) or not x.ndim:
        return run_default(func, args, kwargs)
    dim %= x.ndim
    if axis_splitting(x._spec, dim) is None or not 0 < size <= x.shape[dim] or step <= 0:
        return run_default(func, args, kwargs)  # a whole dim, or torch's own error
    check_stencil_layout("Tensor.unfold", x, (), None)
    axis, sizes, me = dim_split(x, dim)
    count = (x.shape[dim] - size) // step + 1
    out_sizes = conv_output_split(sizes, count, size, step, 1, 0)
    split = DimSplit(dim, axis, sizes, out_sizes, conv_windows(out_sizes, sizes, size, step, 1, 0), me)
    local = gather_inside(local_input(x), x, [split])
    if split.count == 0 and local.shape[dim] < size:  # one filler window, so every rank runs the same graph
        local = F.pad(local, [0, 0] * (x.ndim - 1 - dim) + [0, size - local.shape[dim]])
    windows = drop_filler(local.unfold(dim, size, step), [split])
    shape = (*x.shape[:dim], count, *x.shape[dim + 1 :], size)
    return wrap_local_as(windows, ShardTensorSpec(x.device_mesh, x.placements, shape, output_axis_sizes(x, [split])))


def _unfold_whole_dim(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``aten.unfold`` along a dim every rank holds whole: the slab's own view (DTensor has no rule)."""
    x, dim, size, step = args
    spec = x._spec
    dim %= max(x.ndim, 1)
    if spec.has_partial or axis_splitting(spec, dim) is not None:
        return propagate_and_run(op, args, kwargs)
    view = torch.empty_strided(spec.shape, spec.stride, device="meta").unfold(dim, size, step)
    out = ShardTensorSpec(spec.mesh, spec.placements, view.shape, spec.axis_sizes, view.stride())
    return ShardTensor(x._local_tensor.unfold(dim, size, step), out)


def _unfold_backward_whole_dim(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Its backward: each rank adds its slab's windows back (the unfolded dim is whole on every rank)."""
    grad, input_sizes, dim, size, step = args
    spec = grad._spec
    dim %= len(input_sizes)
    if spec.has_partial or axis_splitting(spec, dim) is not None or axis_splitting(spec, grad.ndim - 1) is not None:
        return propagate_and_run(op, args, kwargs)
    out = ShardTensorSpec(spec.mesh, spec.placements, input_sizes, spec.axis_sizes)
    return ShardTensor(op(grad._local_tensor, out.local_shape(), dim, size, step), out)


def _handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> ShardTensor:
    return (_unfold if func is F.unfold else _fold)(*args, **kwargs)


ShardTensor.register_function_handler(F.unfold, _handler)
# fold takes unfold's strided positions as they are (converting them to a contiguous layout would gather them)
ShardTensor.register_function_handler(F.fold, _handler, strided=True)
ShardTensor.register_function_handler(torch.Tensor.unfold, _sliding_windows)
ShardTensor.register_dispatch_handler(torch.ops.aten.unfold.default, _unfold_whole_dim)
ShardTensor.register_dispatch_handler(torch.ops.aten.unfold_backward.default, _unfold_backward_whole_dim)
