"""Op interception for ShardTensor: registries, the pointwise fast paths, and the fallback hand-off.

Order of decisions, cheapest first:

1. ``__torch_function__``: a registered function handler (halo convolution, normalization,
   ...), else a pointwise torch function whose ShardTensor inputs share one spec and need no
   autograd runs on the slabs directly, before the dispatcher (the cost that decides whether
   small ops are cheaper than on DTensor).  Plain tensors that require grad and meet a
   ShardTensor are made replicated ShardTensors, so their gradient is reduced over the mesh
   exactly once.
2. ``__torch_dispatch__`` (below autograd): a registered aten handler, else a pointwise aten op
   on equal specs runs locally, else the sharding-propagation fallback in ``fallback.py``.

Strided dims (``StridedShard``, the tokens of a 2-D decomposition) reach only handlers that
know them: pointwise ops on equal specs, function handlers registered with ``strided=True`` and
aten handlers registered with :func:`register_strided_handler`.  Every other op gets those inputs
in a contiguous layout first (:func:`~.redistribute.contiguous_layout`), which costs a gather
but is never wrong: a strided tensor the op writes into takes the copy's new values back, and a
write into a view of such a copy raises.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import local_only
from .local_only import RETURNS_VIEWS, local_only_spec, run_aten_on_slabs, run_function_on_slabs

__all__ = [
    "FunctionHandler",
    "DispatchHandler",
    "register_function_handler",
    "register_dispatch_handler",
    "torch_function",
    "torch_dispatch",
    "run_default",
    "bind_shard_tensor_class",
    "POINTWISE_FUNCTIONS",
]

FunctionHandler = Callable[[Any, tuple, tuple, dict], Any]
DispatchHandler = Callable[[torch._ops.OpOverload, tuple, dict], Any]

_function_handlers: dict[Any, FunctionHandler] = {}
_strided_functions: set[Any] = set()
_every_layout_functions: set[Any] = set()
_dispatch_handlers: dict[torch._ops.OpOverload, DispatchHandler] = {}
_strided_handlers: dict[torch._ops.OpOverload, DispatchHandler] = {}
_first_handlers: dict[torch._ops.OpOverload, DispatchHandler] = {}
_ShardTensor: type | None = None


def bind_shard_tensor_class(cls: type) -> None:
    global _ShardTensor
    _ShardTensor = cls
    local_only.bind_shard_tensor_class(cls)


def register_function_handler(func: Any, handler: FunctionHandler, strided: bool = False, every_layout: bool = False) -> None:
    _function_handlers[func] = handler
    for flag, registry in ((strided, _strided_functions), (every_layout, _every_layout_functions)):
        if flag:
            registry.add(func)
        else:
            registry.discard(func)


def registered_function_handler(func: Any) -> FunctionHandler | None:
    """The handler registered for ``func`` (for wrappers that extend it)."""
    return _function_handlers.get(func)


def register_dispatch_handler(op: torch._ops.OpOverload, handler: DispatchHandler, *, first: bool = False) -> None:
    (_first_handlers if first else _dispatch_handlers)[op] = handler
    _aten_plans.clear()


def register_strided_handler(op: torch._ops.OpOverload, handler: DispatchHandler) -> None:
    _strided_handlers[op] = handler


_pointwise_handler: DispatchHandler | None = None


def set_pointwise_handler(handler: DispatchHandler) -> None:
    """The handler for pointwise aten ops whose ShardTensor inputs do not all share one spec
    (``ops/pointwise.py``); it returns ``NotImplemented`` for layouts it leaves to the fallback."""
    global _pointwise_handler
    _pointwise_handler = handler


def _has_strided(args: tuple, kwargs: dict) -> bool:
    cls = _ShardTensor
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, cls) and item._spec.strided:
                return True
    return False


def _map_strided(args: tuple, kwargs: dict, move: Callable[[Any], Any], memo: dict | None = None) -> tuple[tuple, dict]:
    """Arguments with every ShardTensor that has strided dims replaced by ``move(tensor)``
    (moved once each: ``memo`` maps ``id(tensor)`` to its move, and keeps it for the caller)."""
    cls = _ShardTensor
    memo = {} if memo is None else memo

    def convert(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v) for v in value)
        if isinstance(value, cls) and value._spec.strided:
            if id(value) not in memo:
                memo[id(value)] = move(value)
            return memo[id(value)]
        return value

    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


def _contiguous_below_autograd(tensor: Any) -> Any:
    from .redistribute import contiguous_layout, redistribute_local

    target = contiguous_layout(tensor._spec)
    return _ShardTensor(redistribute_local(tensor._local_tensor, tensor._spec, target), target)


# ----- writes into strided tensors ------------------------------------------------------------
# An op that knows no strided layout runs on a contiguous copy of its strided inputs.  An op that
# writes into one (in place, ``out=``, ``x[i] = v``) then wrote into the copy, and the tensor
# itself kept its old values; so the copy's new values are moved back into it.
def _written_tensors(writes: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> list[Any]:
    """The ShardTensors among the arguments an op writes into (:func:`_written_arguments`), lists included."""
    written = []
    for position, name in writes:
        value = args[position] if position < len(args) else kwargs.get(name)
        written.extend(item for item in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(item, _ShardTensor))
    return written


def _written_back(result: Any, written: list[Any], memo: dict[int, Any]) -> Any:
    """Below autograd: each written tensor's slab takes its copy's new values; the result names
    the written tensors themselves, not their copies."""
    from .redistribute import redistribute_local

    copies = {}
    for tensor in written:
        moved = memo[id(tensor)]
        tensor._local_tensor.copy_(redistribute_local(moved._local_tensor, moved._spec, tensor._spec))
        copies[id(moved)] = tensor

    def original(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(original(v) for v in value)
        return copies.get(id(value), value)

    return original(result)


def _written_arguments(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``op`` writes into."""
    return tuple(
        (position, argument.name) for position, argument in enumerate(op._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


# A view of such a copy (``t[:, :4]`` of strided tokens ``t``) is no view of ``t``: a write into it
# would be lost, so such views are marked, and a write into one raises on every rank.
_WRITES_ARE_LOST = "_physics_dp_view_of_a_copy"


def _marked(result: Any) -> Any:
    for item in result if isinstance(result, (list, tuple)) else (result,):
        if isinstance(item, _ShardTensor):
            setattr(item, _WRITES_ARE_LOST, True)
    return result


def _is_view_of_a_copy(tensor: Any) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        base = tensor._base
    return getattr(tensor, _WRITES_ARE_LOST, False) or getattr(base, _WRITES_ARE_LOST, False)


def _refuse_writes_into_copies(op: torch._ops.OpOverload, args: tuple, kwargs: dict, writes: tuple) -> None:
    for target in _written_tensors(writes, args, kwargs):
        if _is_view_of_a_copy(target):
            raise RuntimeError(
                f"{op}: writes into a view of a copy of tokens with strided dims ({tuple(target.shape)}, "
                f"{list(target.placements)}): the view needed data from other ranks, so the write would not reach "
                "the tensor it views. Write into that tensor itself (t[index] = value), or use the out-of-place op."
            )


def _function_destination(func: Any, args: tuple, kwargs: dict) -> Any:
    """The ShardTensor a torch function writes into, if any: ``out=``, ``x[i] = v``, ``x += y``, ``x.op_()``."""
    out = kwargs.get("out")
    if isinstance(out, _ShardTensor):
        return out
    name = getattr(func, "__name__", "")
    in_place = name == "__setitem__" or name.startswith("__i") or (name.endswith("_") and not name.startswith("_"))
    return args[0] if in_place and args and isinstance(args[0], _ShardTensor) else None


def run_with_contiguous_layouts(func: Any, handler: FunctionHandler, types: tuple, args: tuple, kwargs: dict) -> Any:
    """A function handler that knows no strided layout, on contiguous copies of its strided
    inputs; a strided tensor it writes into takes the new values back (a differentiable copy)."""
    from .conversions import redistribute_to_spec, without_strided_dims

    destination = _function_destination(func, args, kwargs)
    args, kwargs = _map_strided(args, kwargs, without_strided_dims, memo := {})
    result = _run_function_handler(func, handler, types, args, kwargs)
    if destination is None or id(destination) not in memo:
        _marked(list(memo.values()))  # views of them in ``result`` are views of copies
        return result
    moved = memo[id(destination)]
    destination.copy_(redistribute_to_spec(moved, destination._spec))
    return destination if result is moved else result


# ----- pointwise torch functions (the fast path before the dispatcher) ----------------------
_UNARY = (
    "abs neg exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh "
    "asinh acosh atanh sigmoid relu erf erfc erfinv floor ceil round trunc frac sign sgn reciprocal "
    "square clamp clip clamp_min clamp_max nan_to_num logical_not bitwise_not lgamma digamma"
).split()
_BINARY = (
    "add sub mul div true_divide pow maximum minimum fmod remainder atan2 hypot logical_and logical_or "
    "logical_xor bitwise_and bitwise_or bitwise_xor copysign floor_divide xlogy lerp addcmul addcdiv"
).split()
_PREDICATES = "eq ne lt le gt ge isnan isinf isfinite signbit".split()
_DUNDERS = (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __pow__ __rpow__ "
    "__neg__ __abs__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __and__ __or__ __xor__ __invert__ "
    "__mod__ __floordiv__ __rfloordiv__"
).split()
_INPLACE_DUNDERS = "__iadd__ __isub__ __imul__ __itruediv__ __ipow__ __iand__ __ior__ __ixor__".split()
_ACTIVATIONS = (
    "relu relu6 gelu silu sigmoid tanh elu leaky_relu softplus mish hardtanh hardswish hardsigmoid "
    "celu selu logsigmoid softsign tanhshrink threshold"
).split()


def _collect_pointwise() -> tuple[frozenset, frozenset]:
    functional, inplace = set(), set()
    for name in _UNARY + _BINARY + _PREDICATES:
        for owner in (torch, torch.Tensor, torch.special):
            if hasattr(owner, name):
                functional.add(getattr(owner, name))
        if hasattr(torch.Tensor, name + "_"):
            inplace.add(getattr(torch.Tensor, name + "_"))
    functional.update(getattr(torch.Tensor, name) for name in _DUNDERS)
    inplace.update(getattr(torch.Tensor, name) for name in _INPLACE_DUNDERS)
    functional.update(getattr(F, name) for name in _ACTIVATIONS)
    return frozenset(functional), frozenset(inplace)


POINTWISE_FUNCTIONS, _INPLACE_POINTWISE_FUNCTIONS = _collect_pointwise()
_ALL_POINTWISE_FUNCTIONS = POINTWISE_FUNCTIONS | _INPLACE_POINTWISE_FUNCTIONS


def _pointwise_function_fast_path(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run on the slabs when every ShardTensor shares one non-Partial spec and no grad is needed."""
    cls = _ShardTensor
    spec = None
    grad_mode = torch.is_grad_enabled()
    needs_autograd = False
    local_args = []
    for arg in args:
        if isinstance(arg, cls):
            if spec is None:
                spec = arg._spec
            elif arg._spec is not spec:
                if arg._spec != spec:
                    return NotImplemented
                arg._spec = spec  # equal specs become one object: the next check is an `is`
            if grad_mode and arg.requires_grad:
                needs_autograd = True
            local_args.append(arg._local_tensor)
        elif isinstance(arg, (torch.Tensor, list, tuple)):
            return NotImplemented
        else:
            local_args.append(arg)
    if needs_autograd:
        # every tensor is a ShardTensor: nothing plain to replicate, straight to the dispatcher
        return NotImplemented if kwargs else _NEEDS_AUTOGRAD
    if spec is None or spec.has_partial:
        return NotImplemented
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return NotImplemented
    in_place = func in _INPLACE_POINTWISE_FUNCTIONS or kwargs.get("inplace")
    if in_place and _is_view_of_a_copy(args[0]):
        return NotImplemented  # the dispatcher refuses it
    result = func(*local_args, **kwargs)
    if in_place:
        return args[0]
    return cls(result, spec)


_NEEDS_AUTOGRAD = object()  # the fast path's answer when an input needs the autograd path


# memory formats under which a contiguous input gives a contiguous output
KEEPS_CONTIGUOUS = (None, torch.preserve_format, torch.contiguous_format)
# ``*_like`` factories that only copy their input's layout (random ones draw per rank: not here)
_LIKE_FACTORIES = frozenset({torch.ones_like, torch.zeros_like, torch.empty_like})
_LIKE_FACTORY_KWARGS = frozenset({"dtype", "memory_format", "requires_grad"})


def _like_factory_fast_path(func: Any, args: tuple, kwargs: dict) -> Any:
    """``ones_like(x)`` and friends on one contiguous, non-Partial ShardTensor: the slab's factory
    wrapped in the input's spec, before the dispatcher (its hand-off to ``__torch_dispatch__``
    cost more than DTensor's whole op).  Anything else (another device, a strided layout) returns
    ``NotImplemented`` and takes the aten path."""
    tensor = args[0] if len(args) == 1 else None
    if not isinstance(tensor, _ShardTensor) or not _LIKE_FACTORY_KWARGS.issuperset(kwargs):
        return NotImplemented
    spec = tensor._spec
    if spec.has_partial or kwargs.get("memory_format") not in KEEPS_CONTIGUOUS or not spec.is_contiguous():
        return NotImplemented
    local = func(tensor._local_tensor, dtype=kwargs.get("dtype"))
    return _ShardTensor(local, spec, requires_grad=kwargs.get("requires_grad", False))


def _replicate_plain_grad_tensors(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Wrap plain tensors requiring grad as replicated ShardTensors on the first ShardTensor's mesh."""
    cls = _ShardTensor
    mesh = None
    needs_wrap = False
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, cls):
                mesh = mesh or item._spec.mesh
            elif isinstance(item, torch.Tensor) and item.requires_grad:
                needs_wrap = True
    if mesh is None or not needs_wrap:
        return args, kwargs
    from .conversions import replicate_plain
    from .dtensor_params import is_dtensor_param, local_replica

    def wrap(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(wrap(v) for v in value)
        if isinstance(value, torch.Tensor) and not isinstance(value, cls) and value.requires_grad:
            return replicate_plain(local_replica(value) if is_dtensor_param(value) else value, mesh)
        return value

    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}


# Metadata reads (``x.shape``, ``x.dim()``, ...) answer from the wrapper alone: model code asks
# hundreds of them per step, and the general path costs 5 us each against 0.2 us on a plain tensor.
_METADATA_READS = frozenset({
    *(getattr(torch.Tensor, name).__get__ for name in (
        "shape", "ndim", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "layout", "is_cuda", "is_meta",
    )),
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.get_device,
})


def torch_function(cls: type, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
    if kwargs is None:
        kwargs = {}
    if torch.compiler.is_dynamo_compiling():
        return _traced_torch_function(_traced_op_key(func), args, kwargs)
    if func in _METADATA_READS:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return _eager_torch_function(func, types, args, kwargs)


_traced_constants: dict[str, Any] = {}
_constant_ids = itertools.count()


@torch.compiler.assume_constant_result  # Dynamo runs it while tracing and keeps the string
def traced_constant_key(value: Any) -> str:
    """A string naming ``value`` (an op, a mesh and placements, ...) in this process: FX graphs
    cannot hold every kind of Python object (builtin methods, device meshes) as an argument,
    but they hold strings; :func:`traced_constant` gives the object back inside the call."""
    key = f"{type(value).__name__}#{next(_constant_ids)}"  # never reused: a graph keeps its key
    _traced_constants[key] = value
    return key


def traced_constant(key: str) -> Any:
    return _traced_constants[key]


def _traced_op_key(func: Any) -> str:
    return traced_constant_key(func)


@torch.compiler.allow_in_graph
def _traced_torch_function(op_key: str, args: tuple, kwargs: dict) -> Any:
    """Under Dynamo, each ShardTensor op is one opaque call in the graph.

    Dynamo cannot build tensor subclasses while it traces, so it records this call instead, and
    AOTAutograd traces through it below: the handlers, their autograd Functions and their (then
    functional) collectives become ATen ops of the forward and backward graphs.
    """
    return _eager_torch_function(traced_constant(op_key), (_ShardTensor,), args, kwargs)


def _eager_torch_function(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    handler = _function_handlers.get(func)
    if handler is not None:
        if func not in _strided_functions and _has_strided(args, kwargs):
            return run_with_contiguous_layouts(func, handler, types, args, kwargs)
        return _run_function_handler(func, handler, types, args, kwargs)
    if func in _AUTOGRAD_ENTRY_POINTS:
        # The backward pass runs Python that meets ShardTensors as the forward did (activation
        # checkpointing recomputes the forward in it; hooks; custom Functions): it must reach the
        # handlers too, so only this entry's own hop is skipped, not torch functions below it.
        return torch.overrides.redispatch_function(func, types, args, kwargs)
    # Below the handlers, tensor properties (``requires_grad``, ...) must not re-enter this
    # function: each re-entry costs microseconds, a third of a small op's overhead.
    with torch._C.DisableTorchFunctionSubclass():
        if func in _LIKE_FACTORIES:
            result = _like_factory_fast_path(func, args, kwargs)
            if result is not NotImplemented:
                return result
        if func in _ALL_POINTWISE_FUNCTIONS:
            result = _pointwise_function_fast_path(func, args, kwargs)
            if result is _NEEDS_AUTOGRAD:
                return func(*args)
            if result is not NotImplemented:
                return result
        return _run_default_unguarded(func, args, kwargs)


def _run_function_handler(func: Any, handler: FunctionHandler, types: tuple, args: tuple, kwargs: dict) -> Any:
    """``handler``, or the function on the slabs where no input needs communication."""
    like = local_only_spec(args, kwargs)
    if like is None or func in _every_layout_functions:
        return handler(func, types, args, kwargs)
    if func in RETURNS_VIEWS:  # torch's own composite: its aten views stay views for autograd
        return run_default(func, args, kwargs)
    return run_function_on_slabs(func, args, kwargs, like)


def run_default(func: Any, args: tuple, kwargs: dict) -> Any:
    """The path below the handlers: torch's own implementation, reaching ``__torch_dispatch__``.

    Handlers that decline a call (an unsupported layout they leave to the fallback) end here.
    """
    with torch._C.DisableTorchFunctionSubclass():
        return _run_default_unguarded(func, args, kwargs)


# gradients are taken *with respect to* their tensor arguments: those must stay the very tensors
_AUTOGRAD_ENTRY_POINTS = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})


def _run_default_unguarded(func: Any, args: tuple, kwargs: dict) -> Any:
    if torch.is_grad_enabled() and func not in _AUTOGRAD_ENTRY_POINTS:
        args, kwargs = _replicate_plain_grad_tensors(args, kwargs)
    return func(*args, **kwargs)


# ----- aten level ---------------------------------------------------------------------------
def _fill_with_scalar_tensor(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``x.fill_(value)`` / ``x[...] = value`` with a 0-d value: local on every slab."""
    target, value = args
    if isinstance(value, _ShardTensor):
        if value.ndim or value._spec.has_partial:
            return _fallback(op, args, kwargs)
        value = value._local_tensor
    if value.ndim or target._spec.has_partial:
        return _fallback(op, args, kwargs)
    op(target._local_tensor, value)
    return target


def _fallback(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    from .fallback import propagate_and_run

    return propagate_and_run(op, args, kwargs)


_dispatch_handlers[torch.ops.aten.fill_.Tensor] = _fill_with_scalar_tensor

_NOT_POINTWISE, _POINTWISE, _POINTWISE_INPLACE = 0, 1, 2
# op -> (registered handler, pointwise kind, handler registered first, the arguments it writes
# into, whether it is a view): one lookup per op on the hot path
_aten_plans: dict[torch._ops.OpOverload, tuple[DispatchHandler | None, int, DispatchHandler | None, tuple, bool]] = {}
_aten = torch.ops.aten
# Elementwise activation gradients that torch does not tag pointwise and DTensor has no rule for
# (``F.relu6``, ``hardswish``, ``logsigmoid``... raised in backward): they read the gradient and the
# activation's input (or output) element by element, as a pointwise op does.
_UNTAGGED_POINTWISE = frozenset({
    _aten.hardtanh_backward.default, _aten.hardswish_backward.default, _aten.hardsigmoid_backward.default,
    _aten.softshrink_backward.default, _aten.hardshrink_backward.default, _aten.leaky_relu_backward.default,
    _aten.elu_backward.default, _aten.softplus_backward.default, _aten.mish_backward.default,
    _aten.log_sigmoid_backward.default,
})


def _classify(op: torch._ops.OpOverload) -> int:
    schema = op._schema
    if (torch.Tag.pointwise not in op.tags and op not in _UNTAGGED_POINTWISE) or any(a.is_out for a in schema.arguments):
        return _NOT_POINTWISE
    if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
        return _POINTWISE_INPLACE
    return _POINTWISE


def _pointwise_aten_local(op: torch._ops.OpOverload, args: tuple, kwargs: dict, kind: int) -> Any:
    cls = _ShardTensor
    spec = None
    local_args = []
    for arg in args:
        if isinstance(arg, cls):
            if spec is None:
                spec = arg._spec
            elif arg._spec is not spec:
                if arg._spec != spec:
                    return NotImplemented
                arg._spec = spec
            local_args.append(arg._local_tensor)
        elif isinstance(arg, torch.Tensor) and arg.ndim:
            return NotImplemented
        else:
            local_args.append(arg)
    if spec is None or spec.has_partial:
        return NotImplemented
    if kwargs:
        if any(isinstance(value, torch.Tensor) for value in kwargs.values()):
            return NotImplemented
        if kwargs.get("memory_format") is torch.contiguous_format and not spec.is_contiguous():
            # Layout is decided from global information only: a slab's own strides differ
            # between ranks where its extents are 0 or 1, and specs must agree on every rank.
            spec = spec.replace()
    result = op._op(*local_args, **kwargs)
    if kind == _POINTWISE_INPLACE:
        return args[0]
    if type(result) is tuple:
        return tuple(cls(r, spec) for r in result)
    return cls(result, spec)


def torch_dispatch(cls: type, op: torch._ops.OpOverload, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
    if kwargs is None:
        kwargs = {}
    plan = _aten_plans.get(op)
    if plan is None:
        plan = _aten_plans[op] = (
            _dispatch_handlers.get(op), _classify(op), _first_handlers.get(op), _written_arguments(op), op.is_view
        )
    if plan[3]:
        _refuse_writes_into_copies(op, args, kwargs, plan[3])
    if plan[4] and getattr(args[0], _WRITES_ARE_LOST, False):
        return _marked(_dispatch_planned(op, args, kwargs, plan))
    return _dispatch_planned(op, args, kwargs, plan)


def _dispatch_planned(op: torch._ops.OpOverload, args: tuple, kwargs: dict, plan: tuple) -> Any:
    handler, kind, first, writes, is_view = plan
    if first is not None:
        result = first(op, args, kwargs)
        if result is not NotImplemented:
            return result
    if handler is None and kind != _NOT_POINTWISE:  # the hottest path first: it is local on any mesh
        result = _pointwise_aten_local(op, args, kwargs, kind)
        if result is not NotImplemented:
            return result
    if _has_strided(args, kwargs):
        strided_handler = _strided_handlers.get(op) or (_pointwise_handler if kind != _NOT_POINTWISE else None)
        result = NotImplemented if strided_handler is None else strided_handler(op, args, kwargs)
        if result is not NotImplemented:
            return result
        written = [t for t in _written_tensors(writes, args, kwargs) if t._spec.strided]
        args, kwargs = _map_strided(args, kwargs, _contiguous_below_autograd, memo := {})
        if written:
            return _written_back(_dispatch_contiguous(op, args, kwargs, handler, kind), written, memo)
        result = _dispatch_contiguous(op, args, kwargs, handler, kind)
        return _marked(result) if is_view else result  # a view of a copy
    return _dispatch_contiguous(op, args, kwargs, handler, kind)


def _dispatch_contiguous(op: torch._ops.OpOverload, args: tuple, kwargs: dict, handler: Any, kind: int) -> Any:
    """The aten handlers and the fallback, for arguments without strided dims."""
    like = local_only_spec(args, kwargs)
    if like is not None:
        return run_aten_on_slabs(op, args, kwargs, like)
    if handler is not None:
        return handler(op, args, kwargs)
    if kind != _NOT_POINTWISE and _pointwise_handler is not None:
        result = _pointwise_handler(op, args, kwargs)
        if result is not NotImplemented:
            return result
    return _fallback(op, args, kwargs)
