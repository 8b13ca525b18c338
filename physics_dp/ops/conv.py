"""Convolutions, transposed convolutions and ``F.pad`` on spatially sharded ShardTensors.

Each rank owns an exact, contiguous range of output positions along every sharded spatial dim:
output ``j`` belongs to the rank owning the input row at the centre of its receptive field
(clamped to the grid), so a stride-1 'same' convolution keeps the input's split and strides
that do not align with shard boundaries neither drop nor duplicate rows.  The rank gathers
the input window its outputs read (:func:`physics_dp.ops.halo.gather_window`: only the rows
peers own are sent), runs the ordinary local op, and wraps the result with the new split.

A transposed convolution gathers the inputs that contribute to its output range, runs the
local transposed convolution without padding and bias, trims or zero-extends the result to
its range, then adds the bias.  ``F.pad`` (also what ``nn.Conv*d`` calls for
``padding_mode != 'zeros'``) is the same window gather with the padding's edge mode.

The common cases skip the window: 'same' convolutions of any stride over shards at multiples
of it (:mod:`.halo_conv`) and upsampling transposed convolutions (:mod:`.halo_conv_transpose`)
run torch's op on the slab itself and add the halo rows' share; their plans (output spec and
halo geometry) are made once per call signature (:mod:`.call_plans`).

Every decision depends only on global shapes and splits, so all ranks run the same
collectives and the same autograd graph, empty shards included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..shard_tensor import Partial, Replicate, ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import function_input
from ._args import bind, per_dim, single_device_shape
from ._local import ShardedOpError, local_input, local_param, sharded_axes, wrap_local
from .call_plans import HaloPlan, PlanCache, hashable, layout_key
from .memory_format import in_output_layout, output_order, weight_like_output
from .halo import Window, gather_window
from .halo_conv import eligible_geometry, halo_conv
from .halo_conv_transpose import eligible_transposed_geometry, halo_conv_transpose

__all__ = [
    "conv_output_split",
    "conv_windows",
    "transposed_output_split",
    "transposed_windows",
    "pad_output_split",
    "window_inside",
    "window_outside",
    "check_stencil_layout",
]

_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_TRANSPOSED_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_TENSOR_ARGS = frozenset({"input", "weight", "bias"})
_PAD_ARGS = ("input", "pad", "mode", "value")
_DEFAULTS = {
    "bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1, "output_padding": 0,
    "mode": "constant", "value": None,
}

# func -> (number of spatial dims, transposed)
_CONVS = {
    F.conv1d: (1, False),
    F.conv2d: (2, False),
    F.conv3d: (3, False),
    F.conv_transpose1d: (1, True),
    F.conv_transpose2d: (2, True),
    F.conv_transpose3d: (3, True),
}


# ----- geometry: pure functions of the split, identical on every rank -------------------------
def _ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def _split_at(sizes: Sequence[int], out_extent: int, boundary: Callable[[int], int]) -> tuple[int, ...]:
    """Output extents per rank, where a slab starting at input row ``o`` starts its outputs at ``boundary(o)``.

    ``boundary`` must be non-decreasing; the first rows go to the first rank and the last to
    the last rank whatever it says, so padding rows are owned too.
    """
    extent = sum(sizes)
    cuts = [
        0 if o <= 0 else out_extent if o >= extent else min(max(boundary(o), 0), out_extent)
        for o, _ in _ranges(sizes)
    ]
    cuts.append(out_extent)
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))


def conv_output_split(
    sizes: Sequence[int], out_extent: int, kernel: int, stride: int, dilation: int, pad_left: int
) -> tuple[int, ...]:
    """Output extents per rank: output ``j`` goes to the owner of input row ``j*stride - pad_left + span//2``."""
    shift = pad_left - dilation * (kernel - 1) // 2
    return _split_at(sizes, out_extent, lambda o: -(-(o + shift) // stride))


def conv_windows(
    out_sizes: Sequence[int], in_sizes: Sequence[int], kernel: int, stride: int, dilation: int, pad_left: int
) -> tuple[Window, ...]:
    """The input rows (padding included, as out-of-range rows) each rank's outputs read."""
    windows = []
    for (a, b), (o, _) in zip(_ranges(out_sizes), _ranges(in_sizes)):
        first = a * stride - pad_left
        windows.append((first, first + (b - a - 1) * stride + dilation * (kernel - 1) + 1) if b > a else (o, o))
    return tuple(windows)


def transposed_output_split(
    sizes: Sequence[int], out_extent: int, kernel: int, stride: int, dilation: int, padding: int
) -> tuple[int, ...]:
    """Output extents per rank: output ``y`` goes to the owner of input row ``(y + padding - span//2) // stride``."""
    shift = dilation * (kernel - 1) // 2 - padding
    return _split_at(sizes, out_extent, lambda o: o * stride + shift)


def transposed_windows(
    out_sizes: Sequence[int], in_sizes: Sequence[int], kernel: int, stride: int, dilation: int, padding: int
) -> tuple[tuple[Window, ...], tuple[int, ...]]:
    """The input rows contributing to each rank's outputs, and the output where each local result starts.

    Input row ``i`` tap ``t`` adds to output ``i*stride - padding + t*dilation``.  A rank whose
    outputs get no contribution (bias only) reads nothing and starts at its first output.
    """
    span, extent = dilation * (kernel - 1), sum(in_sizes)
    windows, origins = [], []
    for (a, b), (o, _) in zip(_ranges(out_sizes), _ranges(in_sizes)):
        lo = max(0, -(-(a + padding - span) // stride))
        hi = min(extent, (b - 1 + padding) // stride + 1)
        if b > a and hi > lo:
            windows.append((lo, hi))
            origins.append(lo * stride - padding)
        else:
            windows.append((o, o))
            origins.append(a)
    return tuple(windows), tuple(origins)


def pad_output_split(sizes: Sequence[int], out_extent: int, pad_left: int) -> tuple[int, ...]:
    """Output extents per rank of ``F.pad``: each keeps its rows, the edge ranks get the padding."""
    return _split_at(sizes, out_extent, lambda o: o + pad_left)


# ----- argument handling ----------------------------------------------------------------------
def _bind_args(names: Sequence[str], args: tuple, kwargs: dict) -> dict[str, Any]:
    return bind(names, args, kwargs, _DEFAULTS)


def _conv_padding(padding: Any, kernel: Sequence[int], dilation: Sequence[int], nd: int) -> list[tuple[int, int]]:
    """(left, right) padding per spatial dim, 'same' and 'valid' resolved as torch does."""
    if padding == "valid":
        return [(0, 0)] * nd
    if padding == "same":
        spans = [d * (k - 1) for d, k in zip(dilation, kernel)]
        return [(s // 2, s - s // 2) for s in spans]
    return [(p, p) for p in per_dim(padding, nd)]


def _stencils(bound: dict[str, Any], nd: int, leading_padding: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(kernel, stride, dilation, leading padding) per spatial dim."""
    kernel = tuple(bound["weight"].shape[2:])
    stride, dilation = per_dim(bound["stride"], nd), per_dim(bound["dilation"], nd)
    return list(zip(kernel, stride, dilation, leading_padding))


def check_stencil_layout(op: str, x: Any, params: Sequence[Any], channel_dim: int | None) -> None:
    """Raise ShardedOpError for layouts a local stencil cannot serve exactly."""
    shards = [t for t in (x, *params) if isinstance(t, ShardTensor)]
    if not isinstance(x, ShardTensor):
        reason = "the input must be a ShardTensor when a parameter is one; distribute the input"
        raise ShardedOpError(op, shards, reason)
    if any(type(p) is Partial for p in x.placements):
        reason = "the input has a pending reduction (Partial); redistribute it to Replicate or Shard first"
        raise ShardedOpError(op, shards, reason)
    if channel_dim is not None and any(dim == channel_dim for _, dim in sharded_axes(x)):
        reason = (
            f"the input is sharded on the channel dim {channel_dim}, which the op mixes; shard batch or spatial "
            "dims instead (redistribute that mesh axis to Replicate or to a spatial Shard first)"
        )
        raise ShardedOpError(op, shards, reason)
    for param in params:
        if isinstance(param, ShardTensor) and any(type(p) is not Replicate for p in param.placements):
            raise ShardedOpError(op, shards, "weight and bias must be plain tensors or replicated ShardTensors")


def _axis_of(x: ShardTensor) -> dict[int, int]:
    """tensor dim -> mesh axis sharding it."""
    return {dim: axis for axis, dim in sharded_axes(x)}


def _gather(
    local: torch.Tensor, x: ShardTensor, dim: int, windows: Sequence[Window], mode: str = "constant", value: float = 0.0
) -> torch.Tensor:
    """``gather_window`` over the mesh axis that shards ``dim`` of ``x``."""
    axis = _axis_of(x)[dim]
    group = x.device_mesh.get_group(axis)
    return gather_window(local, dim, x._spec.axis_sizes[axis], windows, group=group, mode=mode, value=value)


def _pad_dim(t: torch.Tensor, dim: int, left: int, right: int) -> torch.Tensor:
    """Zero-extend (positive) or trim (negative) ``t`` along one dim."""
    if left == 0 and right == 0:
        return t
    pads = [0, 0] * (t.ndim - 1 - dim) + [left, right]
    return F.pad(t, pads)


# ----- the copy-free halo paths, planned once per call signature -------------------------------
_HALO_PLANS = PlanCache()


def _cached_plan(
    func: Any, bound: dict[str, Any], nd: int, build: Callable[[Any, dict[str, Any], int], HaloPlan | None]
) -> HaloPlan | None:
    x, weight, bias = bound["input"], bound["weight"], bound["bias"]
    key = (
        func, layout_key(x), weight.shape, weight.stride(), None if bias is None else bias.shape,
        *(hashable(value) for name, value in bound.items() if name not in _TENSOR_ARGS),
    )
    return _HALO_PLANS.plan(key, x.device_mesh, lambda: build(func, bound, nd))


def _one_sharded_spatial_dim(x: ShardTensor, nd: int) -> tuple[int, int] | None:
    """(mesh axis, tensor dim) of the only sharded spatial dim of a batched input; None for
    unbatched inputs and 2-D decompositions, which take the general path."""
    ndim = x._spec.ndim
    spatial_shards = [(axis, dim) for axis, dim in sharded_axes(x) if dim >= ndim - nd]
    return spatial_shards[0] if ndim == nd + 2 and len(spatial_shards) == 1 else None


def _slab_plan(
    x: ShardTensor, weight: torch.Tensor, geometry: Any, axis: int, out_shape: Sequence[int], out_split: Sequence[int]
) -> HaloPlan | None:
    """The plan of an eligible ``geometry``: the output keeps ``x``'s placements, with ``out_split``
    along ``axis``, in the memory layout torch gives it (:mod:`.memory_format`)."""
    if geometry is None:
        return None
    axis_sizes = list(x._spec.axis_sizes)
    axis_sizes[axis] = tuple(out_split)
    spec = ShardTensorSpec(x.device_mesh, x.placements, out_shape, axis_sizes)
    return HaloPlan(geometry, axis, in_output_layout(spec, output_order(x, weight)))


def _run_plan(plan: HaloPlan, op: Callable, bound: dict[str, Any]) -> ShardTensor:
    """``op(input, weight, bias, geometry, group, out_spec)``: the ShardTensor of the plan's output spec
    (the input whole: the op's Function reads its slab, no conversion node before it)."""
    x = bound["input"]
    weight = weight_like_output(local_param(bound["weight"], x), plan.out_spec)
    group = x.device_mesh.get_group(plan.axis)
    return op(function_input(x), weight, local_param(bound["bias"], x), plan.geometry, group, plan.out_spec)


# ----- convolution ----------------------------------------------------------------------------
def window_inside(window: Window, extent: int) -> Window:
    """The part of ``window`` inside the grid ``[0, extent)`` (possibly empty)."""
    lo = min(max(window[0], 0), extent)
    return lo, max(min(window[1], extent), lo)


def window_outside(window: Window, extent: int) -> tuple[int, int]:
    """How many rows of ``window`` lie before and after the grid."""
    lo, hi = window
    return max(0, min(hi, 0) - lo), max(0, hi - max(lo, extent))


def _gather_sharded(local: torch.Tensor, x: ShardTensor, windows_by_dim: dict[int, tuple[Window, ...]]) -> torch.Tensor:
    """Gather each sharded dim's windows in turn, rows beyond the grid as zeros.

    Zero rows of all but the last dim are made locally after the exchanges, so a later
    exchange (W after H) never sends padding.
    """
    axis_of, coordinate = _axis_of(x), x._spec.coordinate()
    dims = list(windows_by_dim)
    edges = []
    for dim in dims:
        windows = windows_by_dim[dim]
        if dim != dims[-1]:
            edges.append((dim, *window_outside(windows[coordinate[axis_of[dim]]], x.shape[dim])))
            windows = tuple(window_inside(w, x.shape[dim]) for w in windows)
        local = _gather(local, x, dim, windows)
    for dim, left, right in edges:
        local = _pad_dim(local, dim, left, right)
    return local


def _halo_conv_plan(func: Any, bound: dict[str, Any], nd: int) -> HaloPlan | None:
    """:mod:`.halo_conv`'s copy-free path for this call, when the conv is eligible for it."""
    x = bound["input"]
    out_shape = single_device_shape(func, bound)  # torch's own errors for invalid arguments, first
    shard = _one_sharded_spatial_dim(x, nd)
    padding = _conv_padding(bound["padding"], bound["weight"].shape[2:], per_dim(bound["dilation"], nd), nd)
    if shard is None or any(left != right for left, right in padding):
        return None  # asymmetric padding takes the general path too
    (axis, dim), i = shard, shard[1] - (x._spec.ndim - nd)
    spec, stencils = x._spec, _stencils(bound, nd, [left for left, _ in padding])
    kernel, stride, dilation, _ = zip(*stencils)
    geometry = eligible_geometry(
        spec.axis_sizes[axis], spec.coordinate()[axis], dim, kernel[i], stride[i], dilation[i], padding[i],
        padding=tuple(left for left, _ in padding), stride=stride, dilation=dilation, groups=bound["groups"],
    )
    return _slab_plan(x, bound["weight"], geometry, axis, out_shape, conv_output_split(spec.axis_sizes[axis], out_shape[dim], *stencils[i]))


def _conv(func: Any, bound: dict[str, Any], nd: int) -> ShardTensor:
    plan = _cached_plan(func, bound, nd, _halo_conv_plan)
    if plan is not None:
        return _run_plan(plan, halo_conv, bound)
    x = bound["input"]
    out_shape = single_device_shape(func, bound)
    spec, axis_of = x._spec, _axis_of(x)
    padding = _conv_padding(bound["padding"], bound["weight"].shape[2:], per_dim(bound["dilation"], nd), nd)
    stencils = _stencils(bound, nd, [left for left, _ in padding])
    spatial = list(enumerate(range(x.ndim - nd, x.ndim)))
    axis_sizes, windows, counts = list(spec.axis_sizes), {}, {}
    for i, dim in spatial:
        if dim in axis_of:
            axis = axis_of[dim]
            out_sizes = conv_output_split(spec.axis_sizes[axis], out_shape[dim], *stencils[i])
            windows[dim] = conv_windows(out_sizes, spec.axis_sizes[axis], *stencils[i])
            axis_sizes[axis], counts[dim] = out_sizes, out_sizes[spec.coordinate()[axis]]
    local = _gather_sharded(local_input(x), x, windows)
    local_padding = []
    for i, dim in spatial:
        left, right = padding[i]
        if dim not in axis_of and left == right:
            local_padding.append(left)  # a dim held whole with symmetric padding: torch pads it
            continue
        if dim not in axis_of:
            local = _pad_dim(local, dim, left, right)  # 'same' with an even span
        # an empty output range still runs the op (same graph and collectives on every rank)
        kernel, _, dilation, _ = stencils[i]
        local = _pad_dim(local, dim, 0, max(0, dilation * (kernel - 1) + 1 - local.shape[dim]))
        local_padding.append(0)
    weight, bias = local_param(bound["weight"], x), local_param(bound["bias"], x)
    y = func(local, weight, bias, bound["stride"], tuple(local_padding), bound["dilation"], bound["groups"])
    for dim, count in counts.items():
        if y.shape[dim] != count:
            y = y.narrow(dim, 0, count)
    return wrap_local(y, x, out_shape, axis_sizes, output_order(x, bound["weight"]))


def _transposed_halo_plan(func: Any, bound: dict[str, Any], nd: int) -> HaloPlan | None:
    """:mod:`.halo_conv_transpose`'s copy-free path for this call, when the op is eligible for it."""
    x = bound["input"]
    shard = _one_sharded_spatial_dim(x, nd)
    if shard is None:
        return None
    (axis, dim), spec = shard, x._spec
    out_shape = single_device_shape(func, bound)
    stride = per_dim(bound["stride"], nd)
    geometry = eligible_transposed_geometry(
        spec.axis_sizes[axis], spec.coordinate()[axis], dim, bound["weight"].shape[dim], out_shape[dim],
        stride=stride, padding=per_dim(bound["padding"], nd), output_padding=per_dim(bound["output_padding"], nd),
        dilation=per_dim(bound["dilation"], nd), groups=bound["groups"],
    )
    return _slab_plan(x, bound["weight"], geometry, axis, out_shape, [stride[dim - 2] * size for size in spec.axis_sizes[axis]])


def _conv_transpose(func: Any, bound: dict[str, Any], nd: int) -> ShardTensor:
    plan = _cached_plan(func, bound, nd, _transposed_halo_plan)
    if plan is not None:
        return _run_plan(plan, halo_conv_transpose, bound)
    x = bound["input"]
    out_shape = single_device_shape(func, bound)
    spec, axis_of = x._spec, _axis_of(x)
    padding, output_padding = list(per_dim(bound["padding"], nd)), list(per_dim(bound["output_padding"], nd))
    stencils = _stencils(bound, nd, padding)
    axis_sizes, windows, targets = list(spec.axis_sizes), {}, {}
    for i, dim in enumerate(range(x.ndim - nd, x.ndim)):
        if dim in axis_of:
            axis = axis_of[dim]
            sizes, me = spec.axis_sizes[axis], spec.coordinate()[axis]
            out_sizes = transposed_output_split(sizes, out_shape[dim], *stencils[i])
            windows[dim], origins = transposed_windows(out_sizes, sizes, *stencils[i])
            axis_sizes[axis] = out_sizes
            targets[dim] = (sum(out_sizes[:me]) - origins[me], out_sizes[me])  # (first output, count) locally
            padding[i], output_padding[i] = 0, 0
    local = _gather_sharded(local_input(x), x, windows)
    for dim in targets:
        local = _pad_dim(local, dim, 0, max(0, 1 - local.shape[dim]))  # a bias-only range still runs the op
    weight, groups = local_param(bound["weight"], x), bound["groups"]
    y = func(local, weight, None, bound["stride"], tuple(padding), tuple(output_padding), groups, bound["dilation"])
    for dim, (first, count) in targets.items():
        y = _pad_dim(y, dim, -first, first + count - y.shape[dim])
    if bound["bias"] is not None:
        y = y + local_param(bound["bias"], x).reshape(-1, *([1] * nd))
    return wrap_local(y, x, out_shape, axis_sizes, output_order(x, bound["weight"]))


def _conv_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    nd, transposed = _CONVS[func]
    bound = _bind_args(_TRANSPOSED_ARGS if transposed else _CONV_ARGS, args, kwargs)
    x = bound["input"]
    spatial_start = x._spec.ndim - nd if isinstance(x, ShardTensor) else None  # (the check refuses other inputs)
    channel_dim = None if spatial_start is None else spatial_start - 1
    check_stencil_layout(func.__name__, x, (bound["weight"], bound["bias"]), channel_dim)
    if not any(dim >= spatial_start for _, dim in sharded_axes(x)):
        return _local_run(func, bound)
    return _conv_transpose(func, bound, nd) if transposed else _conv(func, bound, nd)


def _local_run(func: Any, bound: dict[str, Any]) -> ShardTensor:
    """No spatial dim is split (batch-sharded or replicated): every rank computes its own slab."""
    x = bound["input"]
    out_shape = single_device_shape(func, bound)
    weight, bias = local_param(bound["weight"], x), local_param(bound["bias"], x)
    values = dict(bound, input=local_input(x), weight=weight, bias=bias)
    return wrap_local(func(*values.values()), x, out_shape, x._spec.axis_sizes, output_order(x, bound["weight"]))


# ----- F.pad ----------------------------------------------------------------------------------
def _pad_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    bound = _bind_args(_PAD_ARGS, args, kwargs)
    x, pad, mode, value = bound["input"], tuple(bound["pad"]), bound["mode"], bound["value"]
    check_stencil_layout("pad", x, (), None)
    out_shape = single_device_shape(func, bound)
    axis_of = _axis_of(x)
    local = local_input(x)
    axis_sizes = list(x._spec.axis_sizes)
    fill = 0.0 if value is None else float(value)
    for i in range(len(pad) // 2):
        dim, left, right = x.ndim - 1 - i, pad[2 * i], pad[2 * i + 1]
        if left == 0 and right == 0:
            continue
        if dim in axis_of:
            axis = axis_of[dim]
            out_sizes = pad_output_split(x._spec.axis_sizes[axis], out_shape[dim], left)
            windows = tuple((a - left, b - left) for a, b in _ranges(out_sizes))
            local = _gather(local, x, dim, windows, mode, fill)
            axis_sizes[axis] = out_sizes
        else:
            extent = local.shape[dim]
            local = gather_window(local, dim, (extent,), ((-left, extent + right),), mode=mode, value=fill)
    # torch keeps channels last except for circular padding
    return wrap_local(local, x, out_shape, axis_sizes, None if mode == "circular" else output_order(x))


for _func in _CONVS:
    ShardTensor.register_function_handler(_func, _conv_handler)
ShardTensor.register_function_handler(F.pad, _pad_handler)
# torch.compile records F.pad as the builtin it wraps; the traced call reaches the handler as that
ShardTensor.register_function_handler(torch._C._nn.pad, _pad_handler)
