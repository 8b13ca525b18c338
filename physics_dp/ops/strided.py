"""Ops on tensors with strided dims (``StridedShard``): the tokens of a 2-D decomposition.

A transformer on an H x W mesh flattens its patch grid into tokens; each rank's tokens are then
its own H x W block, flattened (see :class:`~physics_dp.shard_tensor.placements.StridedShard`).
What the block after the flatten does (token-wise pointwise ops and linears, norms over the
embedding, attention over all tokens, head splits, the unpatchify view) never needs the tokens
in global order, so these handlers keep the layout and move nothing:

- structural ops (permute, transpose, unsqueeze, squeeze, select, unbind, stack, copies and
  ``*_like`` factories) carry each placement to the dim it moves to;
- pointwise ops cut replicated operands (a positional embedding) to the rank's block
  (``pointwise.py``, for every layout);
- sums and means over dims that are not strided stay local; over strided dims they are
  all-reduced like any sharded reduction;
- ``F.linear``/``matmul`` and ``F.layer_norm`` act on the trailing dims: the strided dims are
  viewed as their factors (plain shards), the usual handler runs, and the result is flattened
  back; attention takes strided tokens in ``attention.py``;
- a one-tap ``F.conv1d`` over strided tokens (a channel MLP on flattened ``H*W``, as in
  neuraloperator's FNO) runs as a 1 x 1 convolution over the factors.

Every other op receives such inputs in a contiguous layout (``dispatch.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..distributed import collectives
from ..shard_tensor import Replicate, Shard, ShardTensor, ShardTensorSpec
from ..shard_tensor import dispatch
from ..shard_tensor.fallback import propagate_and_run
from ..shard_tensor.placements import SHARDING_PLACEMENTS, StridedShard
from ..shard_tensor.conversions import without_strided_dims
from . import conv, indexing, linear, normalization  # noqa: F401  (their function handlers are wrapped below)
from ._args import bind, per_dim
from ._local import groups_spanning
from .reductions import accumulate_dtype

aten = torch.ops.aten

__all__ = ["expanded_shape"]


# ----- structural ops: placements follow their dims ---------------------------------------------
def _moved_spec(spec: ShardTensorSpec, new_dim: Callable[[int], int | None], meta_out: torch.Tensor) -> ShardTensorSpec | None:
    placements = []
    for placement in spec.placements:
        if type(placement) in SHARDING_PLACEMENTS:
            dim = new_dim(placement.dim)
            if dim is None:
                return None
            placement = Shard(dim) if type(placement) is Shard else StridedShard(dim, placement.factors, placement.factor)
        placements.append(placement)
    return ShardTensorSpec(spec.mesh, placements, meta_out.shape, spec.axis_sizes, meta_out.stride())


def _meta(spec: ShardTensorSpec, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(spec.shape, spec.stride, dtype=dtype, device="meta")


def _dim_arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = 0) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


def _dim_map(op: torch._ops.OpOverload, args: tuple, kwargs: dict, ndim: int) -> Callable[[int], int | None] | None:
    """Input dim -> output dim for a structural op (None: the dim disappears)."""
    if op is aten.permute.default:
        order = [d % ndim for d in args[1]]
        return order.index
    if op is aten.transpose.int:
        a, b = args[1] % ndim, args[2] % ndim
        return lambda d: b if d == a else a if d == b else d
    if op is aten.unsqueeze.default:
        new = args[1] % (ndim + 1)
        return lambda d: d + (d >= new)
    if op in (aten.select.int, aten.unbind.int):
        gone = _dim_arg(args, kwargs, 1, "dim") % ndim
        return lambda d: None if d == gone else d - (d > gone)
    if op in (aten.squeeze.dim, aten.squeeze.dims):
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        gone = {d % ndim for d in dims}
        return lambda d: None if d in gone else d - sum(g < d for g in gone)
    if op in _ALONG_ONE_DIM:
        return lambda d: d
    return None


def _structural(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    spec = tensor._spec
    if spec.has_partial:
        return NotImplemented
    new_dim = _dim_map(op, args, kwargs, spec.ndim)
    if op in (aten.squeeze.dim, aten.squeeze.dims):
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if any(spec.shape[d % spec.ndim] != 1 for d in dims):  # squeeze leaves dims of extent > 1
            kept = [d for d in dims if spec.shape[d % spec.ndim] == 1]
            args = (tensor, kept)
            op = aten.squeeze.dims
            new_dim = _dim_map(op, args, kwargs, spec.ndim)
    meta_out = op(_meta(spec, tensor.dtype), *args[1:], **kwargs)
    pieces = isinstance(meta_out, (list, tuple))
    specs_by_layout: dict[tuple, ShardTensorSpec | None] = {}  # one per distinct piece: unbind's are alike, split's may differ
    out_specs = []
    for piece in meta_out if pieces else [meta_out]:
        layout = (piece.shape, piece.stride())
        if layout not in specs_by_layout:
            specs_by_layout[layout] = _moved_spec(spec, new_dim, piece)
        out_specs.append(specs_by_layout[layout])
    if None in out_specs:  # the op removes a sharded dim
        return NotImplemented
    local_out = op(tensor._local_tensor, *args[1:], **kwargs)
    return [ShardTensor(t, s) for t, s in zip(local_out, out_specs)] if pieces else ShardTensor(local_out, out_specs[0])


def _along_an_unsharded_dim(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Slices and splits of a dim no mesh axis shards (``t[..., :d]``, ``t.chunk(2, -1)``): the
    slab's own view, placements unchanged; along a sharded dim: declined (a contiguous layout)."""
    spec = args[0]._spec
    dim = _dim_arg(args, kwargs, 1 if op is aten.slice.Tensor else 2, "dim") % spec.ndim
    if any(type(p) in SHARDING_PLACEMENTS and p.dim == dim for p in spec.placements):
        return NotImplemented
    return _structural(op, args, kwargs)


def _stack(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    tensors = args[0]
    specs = [t._spec for t in tensors if isinstance(t, ShardTensor)]
    if len(specs) != len(tensors) or any(s != specs[0] for s in specs) or specs[0].has_partial:
        return NotImplemented
    spec = specs[0]
    dim = _dim_arg(args, kwargs, 1, "dim") % (spec.ndim + 1)
    meta_out = op([_meta(spec, t.dtype) for t in tensors], dim)
    out_spec = _moved_spec(spec, lambda d: d + (d >= dim), meta_out)
    return ShardTensor(op([t._local_tensor for t in tensors], dim), out_spec)


def _same_layout(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Copies, detaches, dtype casts and ``*_like`` factories: the slab's layout is the output's."""
    tensor = args[0]
    spec = tensor._spec
    if spec.has_partial and op not in (aten.detach.default, aten.alias.default):
        return NotImplemented
    local_out = op(tensor._local_tensor, *args[1:], **kwargs)
    if kwargs.get("memory_format") in dispatch.KEEPS_CONTIGUOUS and spec.is_contiguous():
        return ShardTensor(local_out, spec)  # torch's layout rule, without its Python meta call
    meta_kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
    meta_out = op(_meta(spec, tensor.dtype), *args[1:], **meta_kwargs)
    return ShardTensor(local_out, ShardTensorSpec(spec.mesh, spec.placements, spec.shape, spec.axis_sizes, meta_out.stride()))


# ----- reductions ---------------------------------------------------------------------------------
def _reduction(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    spec = tensor._spec
    if spec.has_partial or not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return NotImplemented
    if op is aten.sum.default:
        dims, keepdim, dtype = tuple(range(spec.ndim)), False, _dim_arg(args, kwargs, 1, "dtype", None)
    else:
        given = _dim_arg(args, kwargs, 1, "dim", None)
        dims = tuple(range(spec.ndim)) if not given else tuple(sorted({d % spec.ndim for d in given}))
        keepdim = _dim_arg(args, kwargs, 2, "keepdim", False)
        dtype = _dim_arg(args, kwargs, 3, "dtype", None)
    reduced_axes = [a for a, p in enumerate(spec.placements) if type(p) in SHARDING_PLACEMENTS and p.dim in dims]
    result_dtype = dtype or tensor.dtype  # half precision sums in float32 and rounds once, as on one device
    local = aten.sum.dim_IntList(tensor._local_tensor, list(dims), True, dtype=accumulate_dtype(result_dtype))
    if op is aten.mean.dim:
        local = local / math.prod(spec.shape[d] for d in dims)
    for group in groups_spanning(spec.mesh, tuple(reduced_axes)):
        local = collectives.all_reduce(local, "sum", group)
    local = local.to(result_dtype)
    if not keepdim:
        local = local.squeeze(dims) if dims else local
    placements, sizes = [], []
    for axis, placement in enumerate(spec.placements):
        if axis in reduced_axes or type(placement) not in SHARDING_PLACEMENTS:
            placements.append(Replicate())
            sizes.append(None)
            continue
        shift = 0 if keepdim else sum(d < placement.dim for d in dims)
        dim = placement.dim - shift
        placements.append(Shard(dim) if type(placement) is Shard else StridedShard(dim, placement.factors, placement.factor))
        sizes.append(spec.axis_sizes[axis])
    shape = [1 if d in dims else n for d, n in enumerate(spec.shape) if keepdim or d not in dims]
    return ShardTensor(local.contiguous(), ShardTensorSpec(spec.mesh, placements, shape, sizes))


# ----- functions on trailing dims: strided dims viewed as their factors -------------------------
def expanded_shape(spec: ShardTensorSpec) -> list[int]:
    """The global shape with every strided dim split into its factors."""
    factors = {p.dim: p.factors for p in spec.placements if type(p) is StridedShard}
    return [n for d, extent in enumerate(spec.shape) for n in factors.get(d, (extent,))]


def _through_factors(trailing_dims: Callable[[tuple, dict], int]) -> Callable[[Any], Any]:
    """Wrap a function handler for functions that act on the trailing dims of their first argument.

    Where a strided dim is among those trailing dims, or the second operand has batch dims
    (``matmul`` would broadcast them against the factors), the handler gets contiguous layouts.
    """

    def wrap(original: dispatch.FunctionHandler) -> dispatch.FunctionHandler:
        def handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
            x = args[0]
            spec = x._spec if isinstance(x, ShardTensor) else None
            strided = [] if spec is None else sorted({p.dim for p in spec.placements if type(p) is StridedShard})
            if spec is None or not strided:
                return original(func, types, args, kwargs)
            other = args[1] if len(args) > 1 else None
            if max(strided) >= spec.ndim - trailing_dims(args, kwargs) or isinstance(other, torch.Tensor) and other.ndim > 2:
                return dispatch.run_with_contiguous_layouts(func, original, types, args, kwargs)
            factors = {p.dim: p.factors for p in spec.placements if type(p) is StridedShard}
            out = func(x.view(expanded_shape(spec)), *args[1:], **kwargs)
            for dim in reversed(strided):  # flatten back from the right: earlier dims keep their index
                start = dim + sum(len(factors[d]) - 1 for d in strided if d < dim)
                out = out.flatten(start, start + len(factors[dim]) - 1)
            return out

        return handler

    return wrap


def _is_basic_key(key: Any) -> bool:
    """An index of ints, slices, ``None`` and ``...`` only: views, each along one dim."""
    entries = key if isinstance(key, tuple) else (key,)
    return all(e is None or e is Ellipsis or isinstance(e, (int, slice)) and not isinstance(e, bool) for e in entries)


def _basic_indexing_keeps_the_layout(original: dispatch.FunctionHandler) -> dispatch.FunctionHandler:
    """``t[..., :d]``, ``t[:, :, 1]``, ``t[None]`` on strided tokens: torch's own views, which keep
    the layout along unsharded dims; other keys (lists, masks) on a contiguous layout."""

    def handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        if isinstance(x, ShardTensor) and x._spec.strided and _is_basic_key(args[1]):
            return dispatch.run_default(func, args, kwargs)
        return dispatch.run_with_contiguous_layouts(func, original, types, args, kwargs)

    return handler


def _normalized_dims(args: tuple, kwargs: dict) -> int:
    shape = _dim_arg(args, kwargs, 1, "normalized_shape")
    return 1 if isinstance(shape, int) else len(shape)


_CONV1D_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV1D_DEFAULTS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}
_CONV_OF_RANK = {2: F.conv2d, 3: F.conv3d}


def _is_one_tap(bound: dict[str, Any]) -> bool:
    """Kernel 1, stride 1, no padding: the output at each position depends on that position only."""
    padding = bound["padding"]
    no_padding = padding in ("valid", "same") or per_dim(padding, 1) == (0,)
    return bound["weight"].shape[-1] == 1 and per_dim(bound["stride"], 1) == (1,) and no_padding


def _one_tap_conv1d(original: dispatch.FunctionHandler) -> dispatch.FunctionHandler:
    """A one-tap conv1d mixes channels position by position, so on tokens strided over their last
    dim it runs as a 1 x 1 conv2d/conv3d over the factors (plain shards: no halo, nothing moves).
    Any other conv1d of strided tokens needs them in order and gets a contiguous layout."""

    def handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
        bound = bind(_CONV1D_ARGS, args, kwargs, _CONV1D_DEFAULTS)
        x = bound["input"]
        if not isinstance(x, ShardTensor) or not x._spec.strided:
            return original(func, types, args, kwargs)
        strided = [p for p in x._spec.placements if type(p) is StridedShard]
        factors = strided[0].factors
        if {p.dim for p in strided} != {x.ndim - 1} or len(factors) not in _CONV_OF_RANK or not _is_one_tap(bound):
            bound["input"] = without_strided_dims(x)
            return original(func, types, tuple(bound.values()), {})
        weight = bound["weight"]
        kernel = weight.view(*weight.shape, *[1] * (len(factors) - 1))
        out = _CONV_OF_RANK[len(factors)](x.view(*x.shape[:-1], *factors), kernel, bound["bias"], groups=bound["groups"])
        return out.flatten(-len(factors))

    return handler


def _register_function_wrappers() -> None:
    wrappers = {
        F.conv1d: _one_tap_conv1d,
        F.linear: _through_factors(lambda args, kwargs: 1),
        torch.matmul: _through_factors(lambda args, kwargs: 1),
        torch.Tensor.matmul: _through_factors(lambda args, kwargs: 1),
        torch.Tensor.__matmul__: _through_factors(lambda args, kwargs: 1),
        F.layer_norm: _through_factors(_normalized_dims),
        torch.Tensor.__getitem__: _basic_indexing_keeps_the_layout,
    }
    for func, wrap in wrappers.items():
        original = dispatch.registered_function_handler(func)
        if original is None:
            raise RuntimeError(f"ops/strided.py wraps the handler of {func}, which is not registered yet")
        ShardTensor.register_function_handler(func, wrap(original), strided=True)


# ----- registration -------------------------------------------------------------------------------
_STRUCTURAL = (
    aten.permute.default,
    aten.transpose.int,
    aten.unsqueeze.default,
    aten.select.int,
    aten.unbind.int,
    aten.squeeze.dim,
    aten.squeeze.dims,
)
_ALONG_ONE_DIM = (aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default)
_SAME_LAYOUT = (
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
)
for _op in _STRUCTURAL:
    ShardTensor.register_strided_handler(_op, _structural)
for _op in _ALONG_ONE_DIM:
    ShardTensor.register_strided_handler(_op, _along_an_unsharded_dim)


def _or_fallback(handler: Callable[[torch._ops.OpOverload, tuple, dict], Any]) -> Callable[[torch._ops.OpOverload, tuple, dict], Any]:
    """``handler`` for every layout, DTensor's propagation where it declines."""

    def handle(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        result = handler(op, args, kwargs)
        return propagate_and_run(op, args, kwargs) if result is NotImplemented else result

    return handle


# Transposes (attention blocks transpose on every use): placements follow their dims, where
# DTensor's propagation costs several hundred microseconds per call.  Copies, casts and ``*_like``
# factories (every backward starts from a ``ones_like``): the input's layout, where it cost ~50 us.
for _op in (aten.permute.default, aten.transpose.int):
    ShardTensor.register_dispatch_handler(_op, _or_fallback(_structural))
for _op in _SAME_LAYOUT:
    ShardTensor.register_strided_handler(_op, _same_layout)
    ShardTensor.register_dispatch_handler(_op, _or_fallback(_same_layout))
ShardTensor.register_strided_handler(aten.stack.default, _stack)
for _op in (aten.sum.default, aten.sum.dim_IntList, aten.mean.dim):
    ShardTensor.register_strided_handler(_op, _reduction)
_register_function_wrappers()
