"""``F.interpolate`` / ``nn.Upsample`` on spatially sharded ShardTensors, exact forward and backward.

Every supported mode is separable: along each resized dim, output ``j`` is a weighted sum of a
few input rows (its *taps*), with rows and weights computed from global coordinates by torch's
own formulas (:func:`dim_taps`).  Output ``j`` belongs to the rank owning its source row (the
first tap, clamped to the grid); source rows never decrease with ``j``, so every rank owns a
contiguous range.  The rank gathers the input rows its outputs' taps span (only rows peers own
are sent; taps are clamped to the grid, so no edge rows are ever needed), then resamples each
dim in turn with ``index_select`` and the weights.  ``mode='area'`` is adaptive average pooling
(:mod:`physics_dp.ops.pooling`), for any sizes.  Without a sharded spatial dim
(batch or channel shards) each rank runs torch's own op on its slab.

``antialias=True`` (bilinear, bicubic, lanczos on 4-D inputs) is the same path with torch's
antialias taps (:func:`_antialias_taps`): every row within the filter's support around the
output's center, a support that downsampling by ``s`` widens ``s`` times, clamped to the grid
and renormalized.  An output belongs to the rank holding its center, so a rank receives about
a support's worth of rows from each neighbour; the last dim is resampled first, as torch does.
A dim whose extent a scale factor other than 1 leaves unchanged raises under autograd: torch
copies it forward but resamples it backward.  (torch's CPU kernel is also wrong for an output 1
wide with H resized, every row getting the first row's taps; sharded results follow the filter.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..distributed.tracing import graph_constant, outside_trace
from ..shard_tensor import ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import function_input
from ._args import bind
from ._local import ShardedOpError, local_input, sharded_axes, wrap_local
from .call_plans import HaloPlan, PlanCache, hashable, layout_key
from .memory_format import in_output_layout, output_order
from .conv import check_stencil_layout, window_inside
from .halo_resample import BorderPlan, ResampleGeometry, halo_resample
from .indexing import offsets
from .pooling import DimSplit, dim_split, gather_inside, output_axis_sizes, run_planewise

__all__ = ["Taps", "dim_taps", "resample", "uses_vectorized_nearest"]

_ARGS = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
_DEFAULTS = {"mode": "nearest", "antialias": False}
_CUBIC_A = -0.75
_ANTIALIAS_CUBIC_A = -0.5  # torch's antialiased bicubic follows PIL, not OpenCV
_ANTIALIAS_HALF_WIDTH = {"bilinear": 1.0, "bicubic": 2.0, "lanczos": 3.0}  # the filters' support at scale 1
_ADAPTIVE_AVG = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
_HALO_PLANS = PlanCache()


@dataclass(frozen=True)
class Taps:
    """Every output's input rows (clamped to the grid) and weights along one dim.

    ``rows`` is (outputs, taps); ``weights`` likewise, or None for the nearest modes (a copy).
    ``source`` is the row that decides each output's owner: non-decreasing.
    """

    rows: torch.Tensor
    weights: torch.Tensor | None
    source: torch.Tensor


# ----- torch's source-index formulas (computed in the precision torch uses) ---------------------
def _nearest_rows(extent: int, out: int, scale: float | None, exact: bool, vectorized: bool, dtype: torch.dtype) -> torch.Tensor:
    """Source rows of nearest (``floor(j * s)``) and nearest-exact (``floor((j + 0.5) * s)``).

    torch has two CPU kernels that round differently: the vectorized one (see
    :func:`uses_vectorized_nearest`) works in float32 and, for 'nearest', copies an unchanged extent
    and halves the index of a doubled one whatever the scale factor says; the generic one works
    in the input's precision and rounds to float32 before taking the floor.
    """
    j = torch.arange(out)
    if vectorized:
        if not exact and out == extent:
            return j
        if not exact and out == 2 * extent:
            return j // 2
        s = _scale_value(extent, out, scale, torch.float32)
        position = ((j.double() + 0.5) * s.double()).float() if exact else j.float() * s
    else:
        s = _scale_value(extent, out, scale, dtype)
        if exact:
            source = (s.double() * (j.double() + 0.5) - 0.5).to(dtype).clamp(min=0)
            position = source.float() + 0.5
        else:
            position = (s * j.to(dtype)).float()
    return position.floor().long().clamp(max=extent - 1)


def _scale_value(extent: int, out: int, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Input rows per output row: ``1 / scale_factor`` when torch uses the factor, else ``extent / out``."""
    if scale is not None and scale > 0:
        return torch.tensor(1.0 / scale, dtype=dtype)
    return torch.tensor(extent, dtype=dtype) / out


def _linear_scale(extent: int, out: int, align_corners: bool, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    if align_corners:
        return torch.tensor(extent - 1, dtype=dtype) / (out - 1) if out > 1 else torch.zeros((), dtype=dtype)
    return _scale_value(extent, out, scale, dtype)


def _source_positions(extent: int, out: int, align_corners: bool, scale: float | None, dtype: torch.dtype, cubic: bool) -> torch.Tensor:
    """Real-valued source coordinates; linear modes clamp them at 0, cubic keeps them."""
    s = _linear_scale(extent, out, align_corners, scale, dtype)
    if align_corners:
        return s * torch.arange(out, dtype=dtype)
    position = (s.double() * (torch.arange(out, dtype=torch.float64) + 0.5) - 0.5).to(dtype)  # torch: in double, then rounded
    return position if cubic else position.clamp(min=0)


def _floor_and_fraction(position: torch.Tensor, extent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's guarded floor (at most the last row) and fraction (within [0, 1])."""
    row = position.floor().long().clamp(max=extent - 1)
    return row, (position - row.to(position.dtype)).clamp(0, 1)


def _keys_near(x: torch.Tensor, a: float) -> torch.Tensor:
    """Keys' cubic convolution kernel for distances ``|x| <= 1``."""
    return ((a + 2) * x - (a + 3)) * x * x + 1


def _keys_far(x: torch.Tensor, a: float) -> torch.Tensor:
    """Keys' cubic convolution kernel for distances ``1 < |x| < 2``."""
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a


def _cubic_weights(t: torch.Tensor) -> torch.Tensor:
    """Keys' cubic convolution weights (A = -0.75) of taps floor-1 .. floor+2 for fraction ``t``."""
    a = _CUBIC_A
    return torch.stack([_keys_far(t + 1, a), _keys_near(t, a), _keys_near(1 - t, a), _keys_far(2 - t, a)], dim=1)


# ----- antialias: torch's (and PIL's) filters, stretched by the scale when downsampling -------
def _antialias_filter(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The filter at distance ``x`` (in output pixels): triangle, Keys' cubic with a = -0.5, Lanczos-3."""
    x = x.abs()
    if mode == "bilinear":
        return torch.where(x < 1, 1 - x, 0)
    if mode == "bicubic":
        a = _ANTIALIAS_CUBIC_A
        return torch.where(x < 1, _keys_near(x, a), torch.where(x < 2, _keys_far(x, a), 0))
    return torch.where(x < 3, torch.sinc(x) * torch.sinc(x / 3), 0)


def _normalized(weights: torch.Tensor) -> torch.Tensor:
    """Weights divided by their sum (accumulated in torch's order), unless it is zero."""
    total = weights[:, 0]
    for tap in range(1, weights.shape[1]):
        total = total + weights[:, tap]
    return torch.where(total[:, None] != 0, weights / total[:, None], weights)


def _antialias_taps(extent: int, out: int, mode: str, align_corners: bool, scale: float | None, dtype: torch.dtype) -> Taps:
    """torch's antialiased taps: the rows within the filter's support around each output's center.

    Downsampling by ``s`` widens the support ``s`` times (so every input row counts); the window
    is clamped to the grid and the weights renormalized, so the edges need no rows beyond it.
    Each step rounds where torch's kernel does (``dtype``, double intermediates): the rows are
    torch's, the weights agree to an ulp.  An output is owned by the row holding its center.
    """
    s = _linear_scale(extent, out, align_corners, scale, dtype).double()
    half_width = _ANTIALIAS_HALF_WIDTH[mode]
    wide = bool(s >= 1)
    support = (half_width * s).to(dtype) if wide else torch.tensor(half_width, dtype=dtype)
    inverse = (1 / s).to(dtype) if wide else torch.ones((), dtype=dtype)
    center = (s * (torch.arange(out, dtype=torch.float64) + 0.5)).to(dtype)
    lo = ((center - support).double() + 0.5).long().clamp(min=0)
    hi = ((center + support).double() + 0.5).long().clamp(max=extent)
    count = (hi - lo).clamp(0, 2 * int(support.ceil()) + 1)
    j = torch.arange(int(count.max()))
    distance = ((((lo[:, None] + j).to(dtype) - center[:, None]).double() + 0.5) * inverse.double()).to(dtype)
    weights = torch.where(j < count[:, None], _antialias_filter(distance, mode), 0)
    rows = lo[:, None] + torch.minimum(j, count[:, None] - 1).clamp(min=0)  # past its count: its last row, weight 0
    return Taps(rows, _normalized(weights), center.long().clamp(max=extent - 1))


@functools.lru_cache(maxsize=256)
def dim_taps(
    extent: int,
    out: int,
    mode: str,
    align_corners: bool,
    scale: float | None,
    dtype: torch.dtype,
    vectorized: bool = False,
    antialias: bool = False,
) -> Taps:
    """Taps of ``out`` outputs resampled from ``extent`` rows.

    ``scale`` is the user's scale factor when torch uses it (given and not recomputed), else
    None; ``dtype`` is the precision of the coordinates (float64 for double inputs, else float32);
    ``vectorized``: whether torch's vectorized nearest kernel runs (see :func:`_nearest_rows`);
    ``antialias``: torch's antialiased kernel, which leaves an unchanged extent as it is.
    """
    if antialias:
        if out == extent:
            rows = torch.arange(out)
            return Taps(rows[:, None], None, rows)
        return _antialias_taps(extent, out, mode, align_corners, scale, dtype)
    if mode in ("nearest", "nearest-exact"):
        rows = _nearest_rows(extent, out, scale, mode == "nearest-exact", vectorized, dtype)
        return Taps(rows[:, None], None, rows)
    cubic = mode == "bicubic"
    if out == extent and not cubic:
        scale = None  # torch's linear kernels copy an unchanged extent, whatever the scale factor
    row, t = _floor_and_fraction(_source_positions(extent, out, align_corners, scale, dtype, cubic), extent)
    if cubic:
        rows = (row[:, None] + torch.arange(-1, 3)).clamp(0, extent - 1)
        return Taps(rows, _cubic_weights(t), row.clamp(min=0))
    rows = torch.stack([row, row + (row < extent - 1).long()], dim=1)
    return Taps(rows, torch.stack([1 - t, t], dim=1), row)


# ----- splits and local resampling ------------------------------------------------------------
def _split(taps: Taps, dim: int, axis: int | None, sizes: tuple[int, ...], me: int, factor: int | None = None) -> DimSplit:
    """Outputs go to the owner of their source row, or ``factor`` per input row (torch's kernel on
    the slab: see :mod:`.halo_resample`); each rank's window spans its outputs' taps."""
    starts = offsets(sizes)
    out = taps.source.numel()
    if factor is not None:
        cuts = [factor * start for start in starts] + [out]
    else:
        cuts = torch.searchsorted(taps.source, torch.tensor(starts)).tolist() + [out]
    out_sizes = tuple(b - a for a, b in zip(cuts, cuts[1:]))
    windows = []
    for start, a, b in zip(starts, cuts, cuts[1:]):
        rows = taps.rows[a:b]
        windows.append((int(rows.min()), int(rows.max()) + 1) if b > a else (start, start))
    return DimSplit(dim, axis, sizes, out_sizes, tuple(windows), me)


def resample(window: torch.Tensor, dim: int, taps: Taps, first: int, count: int, origin: int) -> torch.Tensor:
    """Outputs ``first .. first+count`` along ``dim`` from ``window``, whose row 0 is global row ``origin``."""
    with outside_trace():  # taps are planned on the CPU: their slices too, even inside a trace
        planned_rows = taps.rows[first:first + count] - origin
        planned_weights = None if taps.weights is None else taps.weights[first:first + count]
    rows = graph_constant(planned_rows, window.device)
    if planned_weights is None:
        return window.index_select(dim, rows[:, 0])
    shape = [1] * window.ndim
    shape[dim] = count
    weights = graph_constant(planned_weights, window.device).to(window.dtype)
    out = window.index_select(dim, rows[:, 0]) * weights[:, 0].view(shape)
    for tap in range(1, rows.shape[1]):
        out = out + window.index_select(dim, rows[:, tap]) * weights[:, tap].view(shape)
    return out


# ----- handler --------------------------------------------------------------------------------
def _scales(bound: dict[str, Any], nd: int) -> list[float | None]:
    """The scale factor torch's kernels use per dim: the user's, unless sizes are given or recomputed."""
    factor = bound["scale_factor"]
    if factor is None or bound["recompute_scale_factor"]:
        return [None] * nd
    factors = list(factor) if isinstance(factor, (list, tuple)) else [factor] * nd
    return [float(f) for f in factors]


def _coordinate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def uses_vectorized_nearest(x: torch.Tensor, out_shape: torch.Size) -> bool:
    """Whether torch runs nearest modes on its vectorized CPU kernel for this global input.

    2-D: channels-last inputs with more than 3 channels, or outputs with H + W <= 128;
    3-D: channels-last inputs with more than 3 channels; 1-D never.
    """
    if x.ndim not in (4, 5):
        return False
    layout = torch.empty_strided(x.shape, x.stride(), device="meta")
    channels_last = torch.channels_last if x.ndim == 4 else torch.channels_last_3d
    if layout.is_contiguous(memory_format=channels_last) and x.shape[1] > 3:
        return True
    return x.ndim == 4 and out_shape[2] + out_shape[3] <= 128


_NATIVE_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear")
_BINARY_FACTORS = (1, 2, 4, 8)


def _native_factors(x: ShardTensor, bound: dict[str, Any], out_shape: torch.Size) -> list[int] | None:
    """Per-dim integer factors when torch's own kernel on a window equals the global result.

    With a power-of-two factor k (so 1/k is exact) and align_corners off, torch's source
    coordinate of output j is a function of j/k that shifts by exactly ``lo`` rows when the
    input starts at row ``lo`` and the output at ``k * lo``; the window holds every tap of the
    rank's outputs, and it reaches a global edge exactly where torch's clamping does.
    """
    if bound["mode"] not in _NATIVE_MODES or bound["align_corners"] or bound["antialias"]:
        return None
    factors = []
    for dim, scale in zip(range(2, x.ndim), _scales(bound, x.ndim - 2)):
        k, rest = divmod(out_shape[dim], x.shape[dim])
        if rest or k not in _BINARY_FACTORS or scale not in (None, float(k)):
            return None
        factors.append(k)
    return factors


def _rank_borders(whole: Taps, alone: Taps, lo: int, size: int, factor: int) -> tuple[int, int] | None:
    """How many of the rank's first and last outputs its slab alone gets wrong, or None if others are.

    An output comes out right when torch's taps on the slab alone (rows and weights) are its
    global ones; the wrong ones must be a few at each end.
    """
    rows = whole.rows[factor * lo : factor * (lo + size)]
    same = (rows == alone.rows + lo).all(1)
    if whole.weights is not None:
        same &= (whole.weights[factor * lo : factor * (lo + size)] == alone.weights).all(1)
    if not bool(same.any()):
        return None
    top, bottom = int(same.long().argmax()), int(same.flip(0).long().argmax())
    return (top, bottom) if bool(same[top : same.numel() - bottom].all()) else None


@functools.lru_cache(maxsize=256)
def _border_plans(
    sizes: tuple[int, ...], factor: int, mode: str, dtype: torch.dtype, vectorized: bool
) -> tuple[BorderPlan, ...] | None:
    """Every rank's borders when torch's kernel runs on the slabs (see :mod:`.halo_resample`), or None.

    A border's window holds the neighbour's rows its outputs' taps reach (``halo``) and the slab
    rows that either its global taps or the slab's own reach (``inner``).  None where a border
    would need more than the adjacent slab or its own (tiny shards): the window path handles it.
    """
    extent, last = sum(sizes), len(sizes) - 1
    whole = dim_taps(extent, factor * extent, mode, False, float(factor), dtype, vectorized)
    plans = []
    for rank, (lo, size) in enumerate(zip(offsets(sizes), sizes)):
        if size == 0:
            return None
        alone = dim_taps(size, factor * size, mode, False, float(factor), dtype, vectorized)
        wrong = _rank_borders(whole, alone, lo, size, factor)
        if wrong is None or (wrong[0] and rank == 0) or (wrong[1] and rank == last):
            return None
        top, bottom = wrong
        outputs = factor * size
        rows, own_rows = whole.rows[factor * lo : factor * (lo + size)], alone.rows + lo
        halo, inner = [0, 0], [0, 0]
        if top:
            halo[0] = lo - int(rows[:top].min())
            inner[0] = max(int(rows[:top].max()), int(own_rows[:top].max())) + 1 - lo
        if bottom:
            halo[1] = int(rows[outputs - bottom :].max()) + 1 - (lo + size)
            inner[1] = lo + size - min(int(rows[outputs - bottom :].min()), int(own_rows[outputs - bottom :].min()))
        if max(inner) > size or (top and halo[0] > sizes[rank - 1]) or (bottom and halo[1] > sizes[rank + 1]):
            return None
        plans.append(BorderPlan((top, bottom), (halo[0], halo[1]), (inner[0], inner[1])))
    return tuple(plans)


def _resize_splits(
    x: ShardTensor, bound: dict[str, Any], out_shape: torch.Size, factors: Sequence[int] | None, vectorized: bool
) -> list[tuple[DimSplit, Taps]]:
    """Per spatial dim: which outputs each rank owns and the input rows they read, and their taps."""
    mode, align_corners, dtype = bound["mode"], bool(bound["align_corners"]), _coordinate_dtype(x.dtype)
    plans = []
    with outside_trace():
        for dim, scale in zip(range(2, x.ndim), _scales(bound, x.ndim - 2)):
            axis, sizes, me = dim_split(x, dim)
            taps = dim_taps(x.shape[dim], out_shape[dim], mode, align_corners, scale, dtype, vectorized, bool(bound["antialias"]))
            plans.append((_split(taps, dim, axis, sizes, me, None if factors is None else factors[dim - 2]), taps))
    return plans


def _halo_resample_plan(func: Any, bound: dict[str, Any], x: ShardTensor) -> HaloPlan | None:
    """torch's kernel on the slab, borders from the neighbours' rows (:mod:`.halo_resample`): when the
    factors are native, exactly one resized dim is sharded, and its borders allow it."""
    if bound["antialias"] or bound["mode"] == "area":
        return None  # the stretched filter's taps, or adaptive pooling: the handler's other paths
    out_shape = _global_shape(func, bound, x)
    factors = _native_factors(x, bound, out_shape)
    if factors is None:
        return None
    vectorized = uses_vectorized_nearest(x, out_shape)
    splits = [split for split, _ in _resize_splits(x, bound, out_shape, factors, vectorized)]
    sharded = [split for split in splits if split.axis is not None]
    if len(sharded) != 1:
        return None
    split, mode = sharded[0], bound["mode"]
    with outside_trace():
        borders = _border_plans(split.sizes, factors[split.dim - 2], mode, _coordinate_dtype(x.dtype), vectorized)
    if borders is None:
        return None
    geometry = ResampleGeometry(split.dim, mode, tuple(factors), split.sizes, split.me, borders)
    out_spec = ShardTensorSpec(x.device_mesh, x.placements, out_shape, output_axis_sizes(x, splits))
    return HaloPlan(geometry, split.axis, in_output_layout(out_spec, output_order(x)))


def _kept_despite_the_factor(x: ShardTensor, bound: dict[str, Any], out_shape: torch.Size) -> list[int]:
    """Dims whose extent an antialiased resize keeps though their scale factor is not 1.

    torch's antialias forward copies them, but its backward resamples them with the factor's
    weights: no gradient of the forward, so nothing sharded can equal it.
    """
    scales = _scales(bound, x.ndim - 2)
    return [dim for dim, scale in zip(range(2, x.ndim), scales) if out_shape[dim] == x.shape[dim] and scale not in (None, 1.0)]


def _resize(x: ShardTensor, bound: dict[str, Any], out_shape: torch.Size) -> ShardTensor:
    """The general path: the window of input rows each rank's outputs read, resampled locally."""
    mode = bound["mode"]
    factors = _native_factors(x, bound, out_shape)
    plans = _resize_splits(x, bound, out_shape, factors, uses_vectorized_nearest(x, out_shape))
    splits = [split for split, _ in plans]
    local = gather_inside(local_input(x), x, splits)
    if factors is not None and local.numel():  # torch's kernel on the window, then this rank's outputs
        local = F.interpolate(local, scale_factor=[float(k) for k in factors], mode=mode, align_corners=bound["align_corners"])
        crops = tuple(
            (split.dim, split.first - k * window_inside(split.window, split.extent)[0], split.count)
            for split, k in zip(splits, factors)
        )
        local = _Crop.apply(local, crops)
    else:
        for split, taps in plans[::-1] if bound["antialias"] else plans:  # torch's antialias kernel: last dim first
            local = resample(local, split.dim, taps, split.first, split.count, split.window[0])
    return wrap_local(local, x, out_shape, output_axis_sizes(x, splits), output_order(x))


class _Crop(torch.autograd.Function):
    """``narrow`` along several dims, whose backward writes the gradient into its place once.

    Autograd's ``narrow`` backward fills a zero tensor of the window's output size and then copies
    the gradient in, per narrowed dim; here only the few border rows are zeroed.  The window's
    output is about the rank's output, so that saves a full pass over it.
    """

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, crops: tuple[tuple[int, int, int], ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.full_shape, ctx.crops = full.shape, crops
        out = full
        for dim, start, count in crops:
            out = out.narrow(dim, start, count)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        full = grad.new_empty(ctx.full_shape)
        inside = full
        for dim, start, count in ctx.crops:
            extent = full.shape[dim]
            full.narrow(dim, 0, start).zero_()
            full.narrow(dim, start + count, extent - start - count).zero_()
            inside = inside.narrow(dim, start, count)
        inside.copy_(grad)
        return full, None


def _global_shape(func: Any, bound: dict[str, Any], x: ShardTensor) -> torch.Size:
    """The single-device output shape, with torch's own argument checks.

    torch's meta kernels for the linear and cubic modes are Python decompositions costing about
    as much as the op itself; the output size does not depend on the mode, so it comes from the
    nearest kernel's meta function, and the mode's own checks from a call on 2 x 2 pixels.
    """
    pixels = [2] * (x.ndim - 2)
    modes = {name: bound[name] for name in ("mode", "align_corners", "antialias")}
    func(torch.zeros(1, 1, *pixels), size=pixels, **modes)
    sizes = {name: bound[name] for name in ("size", "scale_factor", "recompute_scale_factor")}
    return func(torch.empty(x.shape, dtype=x.dtype, device="meta"), **sizes).shape


def _interpolate_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    bound = bind(_ARGS, args, kwargs, _DEFAULTS)
    x = bound["input"]
    check_stencil_layout("interpolate", x, (), None)
    rest = {name: value for name, value in bound.items() if name != "input"}
    if not any(dim >= 2 for _, dim in sharded_axes(x)):
        local = run_planewise(lambda t: func(t, **rest), local_input(x), x.ndim - 2)
        return wrap_local(local, x, x.shape[:2] + local.shape[2:], x._spec.axis_sizes, output_order(x))
    key = (func, layout_key(x), x.dtype, *(hashable(value) for value in rest.values()))
    plan = _HALO_PLANS.plan(key, x.device_mesh, lambda: _halo_resample_plan(func, bound, x))
    if plan is not None:
        return halo_resample(function_input(x), plan.geometry, x.device_mesh.get_group(plan.axis), plan.out_spec)
    out_shape = _global_shape(func, bound, x)
    mode = bound["mode"]
    differentiated = x.requires_grad and torch.is_grad_enabled()
    kept = _kept_despite_the_factor(x, bound, out_shape) if bound["antialias"] and differentiated else []
    if kept:
        raise ShardedOpError(
            "interpolate", [x],
            f"antialias=True keeps dims {kept} as they are, but torch's backward resamples them with their scale factor "
            "(not the forward's gradient); give size=, recompute_scale_factor=True, or a factor of 1.0 for them",
        )
    if bound["antialias"] and out_shape[-1] == 1 and out_shape[-2] not in (1, x.shape[-2]):
        raise ShardedOpError(
            "interpolate", [x],
            f"antialias=True to a width of 1 while resizing the height ({tuple(x.shape[-2:])} -> {tuple(out_shape[-2:])}): "
            "torch 2.13's CPU kernel then repeats its first output row (not its own separable filter), which a "
            "sharded resize cannot equal; resize the height first and then the width to 1, or drop antialias",
        )
    if mode == "area":
        return _ADAPTIVE_AVG[x.ndim - 2](x, list(out_shape[2:]))
    return _resize(x, bound, out_shape)


ShardTensor.register_function_handler(F.interpolate, _interpolate_handler)
