"""Max, average and adaptive pooling on spatially sharded ShardTensors, exact forward and backward.

A pool is a convolution-shaped stencil, so each rank owns the outputs a convolution would give
it (:func:`physics_dp.ops.conv.conv_output_split`: output ``j`` belongs to the owner of the
input row at the centre of its window) and gathers exactly the input rows those outputs read
(:func:`physics_dp.ops.conv.conv_windows`; only rows inside the grid travel).  Rows beyond the
grid (padding, ``ceil_mode`` overhang) are filled locally: ``-inf`` for max, 0 for average.  The
local op then runs without padding:

- max: the window holds every value the global op compares, in the same scan order, so values
  and ties agree; ``return_indices`` maps the local flat index back to the global spatial plane.
- average: the local op yields window sums (``divisor_override=1``), divided by torch's divisor
  computed from global positions (padding, ``count_include_pad``, ceil overhang, override).
- adaptive: torch's windows (output ``j`` of ``O`` over ``L`` rows reads rows
  ``[floor(j*L/O), ceil((j+1)*L/O))``) vary in size and overlap where ``O`` does not divide ``L``.
  Outputs go to the owner of their window's centre row (the convolution rule) and a rank gathers
  the rows its windows span (:func:`adaptive_split`).  Where the local adaptive op on that window
  would cut different windows (a sharded dim that ``O`` does not divide), the window's rows are
  laid out output by output, each padded to the longest window with filler (``-inf`` for max,
  0 for average; :func:`_spread`): the local op's equal windows are then exactly torch's, scanned
  in torch's order (ties and NaN pick the same index); averages are rescaled from the padded
  length to the true one.

:class:`DimSplit`, :func:`gather_inside` (one resampled dim's splits and windows, and the
gather of all of them) and :func:`run_planewise` are shared with interpolation; the stencil
geometry (:class:`Stencil`, :func:`stencil_splits`, :func:`fill_outside`, :func:`drop_filler`)
with ``F.unfold`` (``unfold.py``).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..distributed.tracing import graph_constant, outside_trace
from ..shard_tensor import ShardTensor
from ._args import bind, per_dim, single_device_shape
from ._local import local_input, sharded_axes, wrap_local
from .memory_format import output_order
from .conv import check_stencil_layout, window_inside, window_outside, conv_output_split, conv_windows
from .halo import Window, gather_window, uniform_windows
from .indexing import offsets

__all__ = [
    "DimSplit", "Stencil", "adaptive_split", "dim_split", "drop_filler", "fill_outside", "gather_inside", "output_axis_sizes",
    "run_planewise", "stencil_splits",
]

_ARGS = {
    "max": ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
    "avg": ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
    "adaptive_max": ("input", "output_size", "return_indices"),
    "adaptive_avg": ("input", "output_size"),
}
_DEFAULTS = {
    "stride": None,
    "padding": 0,
    "dilation": 1,
    "ceil_mode": False,
    "count_include_pad": True,
    "divisor_override": None,
    "return_indices": False,
}

# func -> (kind, number of pooled dims, returns indices)
_POOLS = {
    F.max_pool1d: ("max", 1, False),
    F.max_pool2d: ("max", 2, False),
    F.max_pool3d: ("max", 3, False),
    F.max_pool1d_with_indices: ("max", 1, True),
    F.max_pool2d_with_indices: ("max", 2, True),
    F.max_pool3d_with_indices: ("max", 3, True),
    F.avg_pool1d: ("avg", 1, False),
    F.avg_pool2d: ("avg", 2, False),
    F.avg_pool3d: ("avg", 3, False),
    F.adaptive_max_pool1d: ("adaptive_max", 1, False),
    F.adaptive_max_pool2d: ("adaptive_max", 2, False),
    F.adaptive_max_pool3d: ("adaptive_max", 3, False),
    F.adaptive_max_pool1d_with_indices: ("adaptive_max", 1, True),
    F.adaptive_max_pool2d_with_indices: ("adaptive_max", 2, True),
    F.adaptive_max_pool3d_with_indices: ("adaptive_max", 3, True),
    F.adaptive_avg_pool1d: ("adaptive_avg", 1, False),
    F.adaptive_avg_pool2d: ("adaptive_avg", 2, False),
    F.adaptive_avg_pool3d: ("adaptive_avg", 3, False),
}
_MAX_WITH_INDICES = {1: F.max_pool1d_with_indices, 2: F.max_pool2d_with_indices, 3: F.max_pool3d_with_indices}
_ADAPTIVE_MAX_WITH_INDICES = {
    1: F.adaptive_max_pool1d_with_indices,
    2: F.adaptive_max_pool2d_with_indices,
    3: F.adaptive_max_pool3d_with_indices,
}
_ADAPTIVE_AVG = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


# ----- per-dim splits and windows (shared with interpolation) ---------------------------------
@dataclass(frozen=True)
class DimSplit:
    """One resampled dim: its input split, output split, and every rank's input window.

    A dim held whole is a split over one rank (``axis`` None).  Windows are global rows and may
    reach beyond the grid (padding); :func:`gather_inside` fetches only the rows inside it.
    """

    dim: int
    axis: int | None
    sizes: tuple[int, ...]
    out_sizes: tuple[int, ...]
    windows: tuple[Window, ...]
    me: int

    @property
    def extent(self) -> int:
        return sum(self.sizes)

    @property
    def window(self) -> Window:
        return self.windows[self.me]

    @property
    def first(self) -> int:
        """Global index of this rank's first output."""
        return sum(self.out_sizes[: self.me])

    @property
    def count(self) -> int:
        return self.out_sizes[self.me]


def dim_split(x: ShardTensor, dim: int) -> tuple[int | None, tuple[int, ...], int]:
    """(mesh axis or None, input split, this rank's coordinate) of ``x`` along ``dim``."""
    for axis, sharded in sharded_axes(x):
        if sharded == dim:
            return axis, x._spec.axis_sizes[axis], x._spec.coordinate()[axis]
    return None, (x.shape[dim],), 0


def gather_inside(local: torch.Tensor, x: ShardTensor, splits: Sequence[DimSplit]) -> torch.Tensor:
    """This rank's window rows inside the grid along every split dim.

    Whole dims are narrowed first (less to send), then sharded dims are exchanged in mesh-axis
    order, each carrying the rows gathered before it, so 2-D decompositions get their corners.
    """
    for split in sorted(splits, key=lambda s: -1 if s.axis is None else s.axis):
        inside = tuple(window_inside(w, split.extent) for w in split.windows)
        lo, hi = inside[split.me]
        if split.axis is None:
            if (lo, hi) != (0, local.shape[split.dim]):  # a whole dim is not narrowed: its slice's backward zero-fills the slab
                local = local.narrow(split.dim, lo, hi - lo)
        elif inside != uniform_windows(split.sizes, 0, 0):  # (every window its own slab: nothing moves, no gather node)
            group = x.device_mesh.get_group(split.axis)
            local = gather_window(local, split.dim, split.sizes, inside, group=group)
    return local


def run_planewise(op: Callable[[torch.Tensor], Any], local: torch.Tensor, nd: int) -> Any:
    """``op(local)``, also for an empty slab with an empty channel (or other leading) dim.

    torch's pooling and upsampling kernels accept only an empty batch, so an empty slab runs as
    a batch of its (zero) planes and the results are shaped back; the graph stays connected.
    """
    if local.numel():
        return op(local)
    lead = local.shape[:-nd]
    out = op(local.reshape(math.prod(lead), 1, *local.shape[-nd:]))

    def unflatten(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*lead, *t.shape[-nd:])

    return tuple(unflatten(t) for t in out) if isinstance(out, tuple) else unflatten(out)


def output_axis_sizes(x: ShardTensor, splits: Sequence[DimSplit]) -> list[tuple[int, ...] | None]:
    """``x``'s split per mesh axis with every sharded resampled dim's output split in place."""
    axis_sizes = list(x._spec.axis_sizes)
    for split in splits:
        if split.axis is not None:
            axis_sizes[split.axis] = split.out_sizes
    return axis_sizes


# ----- argument handling ----------------------------------------------------------------------
def _bind_args(names: Sequence[str], args: tuple, kwargs: dict) -> dict[str, Any]:
    return bind(names, args, kwargs, _DEFAULTS)


# ----- geometry -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stencil:
    """Kernel, stride, padding and dilation of one pooled (or unfolded) dim."""

    kernel: int
    stride: int
    padding: int
    dilation: int

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def positions(self, extent: int) -> int:
        """Output positions along a dim of ``extent`` rows, the padding included."""
        return (extent + 2 * self.padding - self.span) // self.stride + 1


def _stencils(kind: str, bound: dict[str, Any], nd: int) -> list[Stencil | None]:
    """Each pooled dim's stencil; None for every dim of an adaptive pool (:func:`adaptive_split`)."""
    if kind not in ("max", "avg"):
        return [None] * nd
    kernel = per_dim(bound["kernel_size"], nd)
    stride = per_dim(bound["stride"], nd) if bound["stride"] not in (None, [], ()) else kernel
    dilation = per_dim(bound["dilation"], nd) if kind == "max" else (1,) * nd
    return [Stencil(*params) for params in zip(kernel, stride, per_dim(bound["padding"], nd), dilation)]


def stencil_splits(x: ShardTensor, out_shape: torch.Size, stencils: Sequence[Stencil | None]) -> list[DimSplit]:
    """Each stencil dim's input split, output split (a convolution's) and every rank's window; a
    None stencil (an adaptive pool's dim) gets torch's adaptive windows."""
    nd = len(stencils)
    splits = []
    for dim, stencil in zip(range(x.ndim - nd, x.ndim), stencils):
        axis, sizes, me = dim_split(x, dim)
        out = out_shape[dim]
        if stencil is None:
            splits.append(adaptive_split(dim, axis, sizes, out, me))
            continue
        k, s, p, d = stencil.kernel, stencil.stride, stencil.padding, stencil.dilation
        out_sizes = conv_output_split(sizes, out, k, s, d, p)
        splits.append(DimSplit(dim, axis, sizes, out_sizes, conv_windows(out_sizes, sizes, k, s, d, p), me))
    return splits


# ----- adaptive windows -----------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _adaptive_windows(extent: int, out: int) -> tuple[Window, ...]:
    """torch's window of every output (``start_index`` / ``end_index`` of ATen's adaptive pools)."""
    return tuple(((j * extent) // out, -(-((j + 1) * extent) // out)) for j in range(out))


@functools.lru_cache(maxsize=256)
def _adaptive_plan(sizes: tuple[int, ...], out: int) -> tuple[tuple[int, ...], tuple[Window, ...]]:
    """Output split and every rank's window: output ``j`` goes to the owner of its window's centre
    row (for windows of equal size, :func:`conv_output_split`'s rule); a rank reads the rows from
    its first output's start to its last one's end, a rank without outputs nothing."""
    windows = _adaptive_windows(sum(sizes), out)
    centres = [(lo + hi - 1) // 2 for lo, hi in windows]
    starts = offsets(sizes)
    cuts = [bisect.bisect_left(centres, start) for start in starts] + [out]
    out_sizes = tuple(b - a for a, b in zip(cuts, cuts[1:]))
    spans = tuple((windows[a][0], windows[b - 1][1]) if b > a else (start, start) for start, a, b in zip(starts, cuts, cuts[1:]))
    return out_sizes, spans


def adaptive_split(dim: int, axis: int | None, sizes: tuple[int, ...], out: int, me: int) -> DimSplit:
    """One adaptive pooled dim's split (a dim held whole reads all of it)."""
    out_sizes, windows = _adaptive_plan(tuple(sizes), out)
    return DimSplit(dim, axis, tuple(sizes), out_sizes, windows, me)


@dataclass(frozen=True)
class _Spread:
    """A rank's window rows along one dim laid out output by output, each padded to the longest
    window with a filler row (a rank without outputs lays out one output of filler).

    ``rows`` index the window with the filler row appended (it is row ``window length``);
    ``sources`` are their global rows (the filler's: the window's start, never selected);
    ``rescale`` per output turns an average over the padded length into one over the window's.
    """

    rows: torch.Tensor
    sources: torch.Tensor
    rescale: torch.Tensor


@functools.lru_cache(maxsize=256)
def _spread_plan(sizes: tuple[int, ...], out: int, me: int) -> _Spread:
    windows = _adaptive_windows(sum(sizes), out)
    taps = max(hi - lo for lo, hi in windows)
    out_sizes, spans = _adaptive_plan(sizes, out)
    first, count, (origin, end) = sum(out_sizes[:me]), out_sizes[me], spans[me]
    rows, sources, rescale = [], [], []
    for lo, hi in windows[first:first + count] or [(origin, origin)]:
        rows += [row - origin for row in range(lo, hi)] + [end - origin] * (taps - (hi - lo))
        sources += list(range(lo, hi)) + [origin] * (taps - (hi - lo))
        rescale.append(taps / max(hi - lo, 1))
    return _Spread(torch.tensor(rows), torch.tensor(sources), torch.tensor(rescale[:count], dtype=torch.float64))


def _spreads(kind: str, splits: Sequence[DimSplit], out_shape: torch.Size) -> dict[int, _Spread]:
    """The spread of every sharded dim an adaptive pool's output size does not divide.

    Elsewhere the local adaptive op on the window cuts torch's windows itself: a whole dim is the
    global op's, and equal windows tile a rank's window.
    """
    if kind in ("max", "avg"):
        return {}
    with outside_trace():
        return {
            split.dim: _spread_plan(split.sizes, out_shape[split.dim], split.me)
            for split in splits
            if split.axis is not None and out_shape[split.dim] and split.extent % out_shape[split.dim]
        }


def _spread(local: torch.Tensor, dim: int, spread: _Spread, value: float) -> torch.Tensor:
    """``local`` (the window) laid out as ``spread`` says along ``dim``, the filler row holding ``value``."""
    filler = local.new_full((*local.shape[:dim], 1, *local.shape[dim + 1:]), value)
    return torch.cat([local, filler], dim).index_select(dim, graph_constant(spread.rows, local.device))


# ----- local computation ----------------------------------------------------------------------
def fill_outside(local: torch.Tensor, splits: Sequence[DimSplit], stencils: Sequence[Stencil | None], value: float) -> torch.Tensor:
    """Add the window's rows beyond the grid, filled with ``value``.

    A rank without outputs along a dim gets one output's worth of filler rows, so it still runs
    the op (the same autograd graph and collectives on every rank); that output is dropped later.
    """
    pads: list[int] = []
    for split, stencil in zip(reversed(splits), reversed(stencils)):
        left, right = window_outside(split.window, split.extent)
        if split.count == 0:
            need = 1 if stencil is None else stencil.span
            right += max(0, need - (local.shape[split.dim] + left + right))
        pads += [left, right]
    if not any(pads):
        return local
    return F.pad(local, pads, value=value)


def _window_sums(local: torch.Tensor, stencils: Sequence[Stencil]) -> torch.Tensor:
    kernel, stride = tuple(s.kernel for s in stencils), tuple(s.stride for s in stencils)
    if len(stencils) == 1:  # avg_pool1d has no divisor_override
        return F.avg_pool2d(local.unsqueeze(-2), (1, *kernel), (1, *stride), 0, False, True, 1).squeeze(-2)
    pool = F.avg_pool2d if len(stencils) == 2 else F.avg_pool3d
    return pool(local, kernel, stride, 0, False, True, 1)


def _divisor(splits: Sequence[DimSplit], stencils: Sequence[Stencil], include_pad: bool, ndim: int) -> torch.Tensor:
    """Torch's divisor for this rank's outputs, from their global positions, as a broadcastable tensor."""
    total = torch.ones((), dtype=torch.int64)
    for split, stencil in zip(splits, stencils):
        start = torch.arange(split.first, split.first + split.count) * stencil.stride - stencil.padding
        end = (start + stencil.kernel).clamp(max=split.extent + stencil.padding)
        size = end - start if include_pad else end.clamp(max=split.extent) - start.clamp(min=0)
        shape = [1] * ndim
        shape[split.dim] = split.count
        total = total * size.view(shape)
    return total


def _global_indices(
    index: torch.Tensor, splits: Sequence[DimSplit], local_extents: Sequence[int], sources: dict[int, torch.Tensor]
) -> torch.Tensor:
    """Flat indices into the local window's spatial plane, mapped to the global input's plane
    (along a spread dim through the global row of each local row, ``sources``)."""
    coordinates, rest = [], index
    for split, extent in zip(reversed(splits), reversed(local_extents)):
        local = rest % extent
        rows = sources.get(split.dim)
        coordinates.append(local + split.window[0] if rows is None else graph_constant(rows, index.device)[local])
        rest = rest // extent
    flat = torch.zeros_like(index)
    for split, coordinate in zip(splits, reversed(coordinates)):
        flat = flat * split.extent + coordinate
    return flat


def _run_local(kind: str, local: torch.Tensor, splits: Sequence[DimSplit], stencils: Sequence[Any]) -> Any:
    """The pool over the filled window without padding: values, and local flat indices for max kinds."""
    nd = len(splits)
    if kind == "max":
        kernel, stride = tuple(s.kernel for s in stencils), tuple(s.stride for s in stencils)
        dilation = tuple(s.dilation for s in stencils)
        return _MAX_WITH_INDICES[nd](local, kernel, stride, 0, dilation, False, True)
    if kind == "avg":
        return _window_sums(local, stencils)
    sizes = tuple(max(split.count, 1) for split in splits)
    if kind == "adaptive_max":
        return _ADAPTIVE_MAX_WITH_INDICES[nd](local, sizes, True)
    return _ADAPTIVE_AVG[nd](local, sizes)


def drop_filler(t: torch.Tensor, splits: Sequence[DimSplit]) -> torch.Tensor:
    """Drop the output a rank without outputs along a dim computed from filler rows."""
    for split in splits:
        if split.count == 0:
            t = t.narrow(split.dim, 0, 0)
    return t


def _pool(func: Any, bound: dict[str, Any]) -> Any:
    kind, nd, with_indices = _POOLS[func]
    x = bound["input"]
    out_shape = single_device_shape(func, bound)
    stencils = _stencils(kind, bound, nd)
    splits = stencil_splits(x, out_shape, stencils)
    filler = -math.inf if "max" in kind else 0.0
    local = gather_inside(local_input(x), x, splits)
    spreads = _spreads(kind, splits, out_shape)
    for dim, spread in spreads.items():
        local = _spread(local, dim, spread, filler)
    local = fill_outside(local, splits, stencils, filler)
    # without padding or overhang, torch's divisor is the kernel's (or the override): its own op on the window
    plain_avg = kind == "avg" and not bound["ceil_mode"] and not any(s.padding for s in stencils)
    if plain_avg:
        out = run_planewise(lambda t: func(*dict(bound, input=t).values()), local, nd)
        y = drop_filler(out, splits)
    else:
        out = run_planewise(lambda t: _run_local(kind, t, splits, stencils), local, nd)
        y = drop_filler(out[0] if isinstance(out, tuple) else out, splits)
    if kind == "avg" and not plain_avg:
        override = bound.get("divisor_override")
        y = y / (override or _divisor(splits, stencils, bound["count_include_pad"], y.ndim).to(device=y.device, dtype=y.dtype))
    if kind == "adaptive_avg":
        for dim, spread in spreads.items():  # the local op divided by the padded length
            shape = [1] * y.ndim
            shape[dim] = spread.rescale.numel()
            y = y * graph_constant(spread.rescale, y.device).to(y.dtype).view(shape)
    axis_sizes, order = output_axis_sizes(x, splits), output_order(x)
    result = wrap_local(y, x, out_shape, axis_sizes, order)
    if not with_indices:
        return result
    local_extents = [local.shape[split.dim] for split in splits]
    sources = {dim: spread.sources for dim, spread in spreads.items()}
    index = _global_indices(drop_filler(out[1], splits), splits, local_extents, sources)
    return result, wrap_local(index, x, out_shape, axis_sizes, order)


# ----- handler --------------------------------------------------------------------------------
def _local_run(func: Any, bound: dict[str, Any], nd: int) -> Any:
    """No pooled dim is split (batch or channel shards, replicas): each rank pools its own slab."""
    x = bound["input"]
    out = run_planewise(lambda t: func(*dict(bound, input=t).values()), local_input(x), nd)

    def wrap(t: torch.Tensor) -> ShardTensor:
        return wrap_local(t, x, x.shape[:-nd] + t.shape[-nd:], x._spec.axis_sizes, output_order(x))

    return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def _pool_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    kind, nd, _ = _POOLS[func]
    names = _ARGS[kind][:-1] if (kind, nd) == ("avg", 1) else _ARGS[kind]  # avg_pool1d has no divisor_override
    bound = _bind_args(names, args, kwargs)
    x = bound["input"]
    check_stencil_layout(func.__name__, x, (), None)
    if not any(dim >= x.ndim - nd for _, dim in sharded_axes(x)):
        return _local_run(func, bound, nd)
    return _pool(func, bound)


for _func in _POOLS:
    ShardTensor.register_function_handler(_func, _pool_handler)
