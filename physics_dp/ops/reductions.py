"""Sharded reductions at the aten level: sum, mean, var/std, max/min, argmax/argmin, norms, logsumexp.

Handlers run below autograd on the slabs, so torch's own backward formulas apply unchanged; their
backward ops (expand, eq, scatter, and reductions registered here, e.g. the tie count in amax's
gradient) dispatch through ShardTensor in turn.

A handler reduces its slab, then combines along each mesh axis that shards a reduced dim (or once
over the job when those axes are the whole mesh) with one collective the size of the output (never
of the input):

- sum, mean: all-reduce of the local sums; mean divides by the true global count, so uneven and
  empty shards weigh right;
- var, std (and var_mean, std_mean): all-gather of (count, mean, M2), merged with Chan et al.'s
  parallel algorithm (no E[x^2] - E[x]^2 cancellation; shared with normalization.py);
- max, min, amax, amin, aminmax: all-reduce of the local extreme and a NaN flag (NaN propagates like torch);
- max.dim, min.dim, argmax, argmin: all-gather of (value, global index); NaN wins, ties go to the
  smallest global index (torch's first occurrence);
- logsumexp: all-gather of the local logsumexp, combined by logsumexp;
- linalg_vector_norm (torch.norm, Tensor.norm): all-gather of the local norms, combined by the
  same norm (a sum for ord=0).

Reduced axes become Replicate; axes sharding kept dims stay Shard with their split.  Without a
sharded reduced dim the op runs on the slab with no communication.  Pending reductions
(``Partial``) in the input are resolved first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..shard_tensor import Replicate, Shard, ShardTensor, ShardTensorSpec
from ..shard_tensor.redistribute import redistribute_local
from ..shard_tensor.spec import contiguous_strides
from ._local import ShardedOpError, groups_spanning
from .moments import global_moments

__all__ = ["accumulate_dtype"]

aten = torch.ops.aten
_NO_INDEX = torch.iinfo(torch.int64).max  # the index of an empty shard's candidate: never the smallest


# ----- planning ---------------------------------------------------------------------------------
def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    values = {}
    for position, argument in enumerate(op._schema.arguments):
        if position < len(args):
            values[argument.name] = args[position]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        else:
            values[argument.name] = argument.default_value if argument.has_default_value() else None
    return values


def _reduced_dims(dim: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Non-negative reduced dims; ``None`` and ``[]`` mean every dim, as in torch."""
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else dim
    return tuple(sorted({d % max(ndim, 1) for d in dims}))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A reduction of one ShardTensor: its slab, the reduced dims, and where the result lives."""

    tensor: ShardTensor
    local: torch.Tensor
    dims: tuple[int, ...]
    keepdim: bool
    groups: tuple[ProcessGroup, ...]  # spanning the mesh axes that shard a reduced dim
    out_spec: ShardTensorSpec

    def wrap(self, local: torch.Tensor) -> ShardTensor:
        if not self.keepdim:
            local = local.squeeze(self.dims) if self.dims else local
        return ShardTensor(local.contiguous(), self.out_spec)


def _replicate_partials(tensor: ShardTensor) -> torch.Tensor:
    """The slab with pending reductions applied (reductions here are not all linear)."""
    spec = tensor._spec
    if not spec.has_partial:
        return tensor._local_tensor
    placements = [Replicate() if p.is_partial() else p for p in spec.placements]
    resolved = spec.replace(placements=placements, axis_sizes=spec.axis_sizes)
    return redistribute_local(tensor._local_tensor, spec, resolved)


def _plan(tensor: ShardTensor, dim: int | Sequence[int] | None, keepdim: bool) -> _Plan:
    spec = tensor._spec
    dims = _reduced_dims(dim, spec.ndim)
    reduced_axes, placements, sizes = [], [], []
    for axis, placement in enumerate(spec.placements):
        if type(placement) is Shard and placement.dim in dims:
            reduced_axes.append(axis)
            placements.append(Replicate())
            sizes.append(None)
        elif type(placement) is Shard:
            shift = 0 if keepdim else sum(d < placement.dim for d in dims)
            placements.append(Shard(placement.dim - shift))
            sizes.append(spec.axis_sizes[axis])
        else:
            placements.append(Replicate())
            sizes.append(None)
    shape = [1 if d in dims else s for d, s in enumerate(spec.shape) if keepdim or d not in dims]
    out_spec = ShardTensorSpec(spec.mesh, placements, shape, sizes)
    groups = tuple(groups_spanning(spec.mesh, tuple(reduced_axes)))
    return _Plan(tensor, _replicate_partials(tensor), dims, keepdim, groups, out_spec)


def _run_locally(op: torch._ops.OpOverload, plan: _Plan, args: tuple, kwargs: dict) -> Any:
    """Every reduced dim is whole on this rank: the op on the slab is the global result."""
    result = op(plan.local, *args[1:], **kwargs)
    if isinstance(result, tuple):
        return tuple(ShardTensor(r, plan.out_spec) for r in result)
    return ShardTensor(result, plan.out_spec)


def _needs_no_communication(plan: _Plan) -> bool:
    """No reduced dim is sharded, or the reduction is empty (torch raises or returns its identity)."""
    return not plan.groups or math.prod(plan.tensor._spec.shape[d] for d in plan.dims) == 0


def _refuse_complex(op: torch._ops.OpOverload, plan: _Plan) -> None:
    """The merges below order or square values, which complex numbers do not support that way."""
    if plan.local.is_complex():
        raise ShardedOpError(str(op), [plan.tensor], "complex inputs reduced over a sharded dim are not supported")


# ----- collectives on reduced values ----------------------------------------------------------------
def _all_reduce(value: torch.Tensor, reduce_op: str, groups: Sequence[ProcessGroup]) -> torch.Tensor:
    if value.is_complex():  # sums only: max/min of complex numbers are undefined (torch raises first)
        return torch.view_as_complex(_all_reduce(torch.view_as_real(value), reduce_op, groups))
    for group in groups:
        if value.numel():  # every rank of a group has the same output shape, so all skip together
            value = collectives.all_reduce(value, reduce_op, group)
    return value


def _gather(value: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every group rank's ``value`` stacked along a new dim 0 (in group-rank order)."""
    parts = torch.distributed.get_world_size(group)
    if value.numel() == 0:
        return value.new_empty((parts, *value.shape))
    return collectives.all_gather_rows(value.reshape(-1), group).view(parts, *value.shape)


# ----- sum, mean --------------------------------------------------------------------------------
def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision sums accumulate in float32, as torch's own kernels do."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _sum(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    a = _bind(op, args, kwargs)
    plan = _plan(a["self"], a.get("dim"), bool(a.get("keepdim")))
    if _needs_no_communication(plan):
        return _run_locally(op, plan, args, kwargs)
    add_up = torch.nansum if op is aten.nansum.default else torch.sum
    dtype = a["dtype"] or plan.local.dtype
    # half precision: the partial sums stay float32 until the total is rounded once, as on one
    # device; other dtypes keep torch's own (integer sums promote with dtype None)
    widened = accumulate_dtype(dtype) is not dtype
    total = add_up(plan.local, plan.dims, keepdim=True, dtype=accumulate_dtype(dtype) if widened else a["dtype"])
    total = _all_reduce(total, "sum", plan.groups)
    return plan.wrap(total.to(dtype) if widened else total)


def _mean(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    a = _bind(op, args, kwargs)
    plan = _plan(a["self"], a.get("dim"), bool(a.get("keepdim")))
    if _needs_no_communication(plan):
        return _run_locally(op, plan, args, kwargs)
    dtype = a["dtype"] or plan.local.dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(
            "mean(): could not infer output dtype. Input dtype must be either a floating point or complex dtype. "
            f"Got: {dtype}"
        )
    total = torch.sum(plan.local, plan.dims, keepdim=True, dtype=accumulate_dtype(dtype))
    count = math.prod(plan.tensor._spec.shape[d] for d in plan.dims)
    return plan.wrap((_all_reduce(total, "sum", plan.groups) / count).to(dtype))


# ----- var, std -----------------------------------------------------------------------------------
def _variance_family(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """var, std, var_mean, std_mean (``.correction`` overloads) from merged moments."""
    a = _bind(op, args, kwargs)
    plan = _plan(a["self"], a["dim"], bool(a["keepdim"]))
    if _needs_no_communication(plan):
        return _run_locally(op, plan, args, kwargs)
    _refuse_complex(op, plan)
    if not plan.local.is_floating_point():
        raise RuntimeError(f"std and var only support floating point and complex dtypes, got {plan.local.dtype}")
    count, mean, biased = global_moments(plan.local, plan.dims, plan.groups)
    correction = 1 if a["correction"] is None else a["correction"]
    var = biased * count / (count - correction).clamp(min=0)
    dtype = plan.local.dtype
    spread = var.sqrt() if op.overloadpacket in (aten.std, aten.std_mean) else var
    if op.overloadpacket in (aten.var_mean, aten.std_mean):
        return plan.wrap(spread.to(dtype)), plan.wrap(mean.to(dtype))
    return plan.wrap(spread.to(dtype))


# ----- max, min, amax, amin -------------------------------------------------------------------------
def _lowest(dtype: torch.dtype, largest: bool) -> float | int:
    """The identity of max (``largest``) or min over ``dtype``: what an empty shard contributes."""
    if dtype.is_floating_point:
        return -math.inf if largest else math.inf
    info = torch.iinfo(dtype)
    return info.min if largest else info.max


def _local_extreme(local: torch.Tensor, dims: tuple[int, ...], largest: bool) -> torch.Tensor:
    if any(local.shape[d] == 0 for d in dims):
        shape = [1 if d in dims else s for d, s in enumerate(local.shape)]
        return torch.full(shape, _lowest(local.dtype, largest), dtype=local.dtype, device=local.device)
    reduce = torch.amax if largest else torch.amin
    return reduce(local, dims, keepdim=True)


def _extreme(plan: _Plan, largest: bool) -> torch.Tensor:
    """Global max/min over the plan's dims; NaN anywhere makes the result NaN, as in torch."""
    reduce_op = "max" if largest else "min"
    if not plan.local.is_floating_point():
        value = _local_extreme(plan.local.long(), plan.dims, largest)
        return _all_reduce(value, reduce_op, plan.groups).to(plan.local.dtype)
    value = _local_extreme(plan.local, plan.dims, largest)
    has_nan = value.isnan()
    flag = has_nan.to(value.dtype) if largest else -has_nan.to(value.dtype)
    packed = torch.stack([value.masked_fill(has_nan, _lowest(value.dtype, largest)), flag])
    packed = _all_reduce(packed, reduce_op, plan.groups)
    return torch.where(packed[1] != 0, math.nan, packed[0])


def _extreme_handler(largest: bool) -> Callable[[torch._ops.OpOverload, tuple, dict], ShardTensor]:
    def handle(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
        a = _bind(op, args, kwargs)
        plan = _plan(a["self"], a.get("dim"), bool(a.get("keepdim")))
        if _needs_no_communication(plan):
            return _run_locally(op, plan, args, kwargs)
        _refuse_complex(op, plan)
        return plan.wrap(_extreme(plan, largest))

    return handle


def _aminmax(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[ShardTensor, ShardTensor]:
    """``aminmax`` as amin and amax: an empty shard contributes their identities (torch's kernel on
    an empty slab raises on that rank alone, leaving the others in the collective)."""
    a = _bind(op, args, kwargs)
    plan = _plan(a["self"], a.get("dim"), bool(a.get("keepdim")))
    if _needs_no_communication(plan):
        return _run_locally(op, plan, args, kwargs)
    _refuse_complex(op, plan)
    return plan.wrap(_extreme(plan, largest=False)), plan.wrap(_extreme(plan, largest=True))


# ----- max.dim, min.dim, argmax, argmin --------------------------------------------------------------
def _local_candidate(plan: _Plan, dim: int | None, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This slab's best value and its GLOBAL index (flat over the global shape when ``dim`` is None)."""
    local = plan.local
    offsets = plan.tensor._spec.offsets()
    shape = [1 if d in plan.dims else s for d, s in enumerate(local.shape)]
    if local.numel() == 0 if dim is None else local.shape[dim] == 0:
        value = torch.full(shape, _lowest(local.dtype, largest), dtype=local.dtype, device=local.device)
        return value, torch.full(shape, _NO_INDEX, dtype=torch.int64, device=local.device)
    pick = torch.max if largest else torch.min
    if dim is not None:
        value, index = pick(local, dim, keepdim=True)
        return value, index + offsets[dim]
    flat = local.reshape(-1)
    position = torch.argmax(flat) if largest else torch.argmin(flat)
    coordinates = torch.unravel_index(position, local.shape)
    strides = contiguous_strides(plan.tensor.shape)
    index = sum((c + o) * s for c, o, s in zip(coordinates, offsets, strides))
    return flat[position].reshape(shape), torch.as_tensor(index, device=local.device).reshape(shape)


def _select(values: torch.Tensor, indices: torch.Tensor, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Best of the candidates along dim 0: NaN first, then the extreme value, ties to the smallest index."""
    best = values.amax(0) if largest else values.amin(0)  # propagates NaN
    nan = values.isnan()
    hit = torch.where(nan.any(0), nan, values == best)
    return best, torch.where(hit, indices, _NO_INDEX).amin(0)


def _arg_extreme(plan: _Plan, dim: int | None, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    value, index = _local_candidate(plan, dim, largest)
    exact = torch.int64 if not value.is_floating_point() else torch.float64  # holds both losslessly
    for group in plan.groups:
        gathered = _gather(torch.stack([value.to(exact), index.to(exact)]), group)  # (ranks, 2, *out)
        best, index = _select(gathered[:, 0], gathered[:, 1].long(), largest)
        value = best.to(value.dtype)
    return value, index


def _value_index_handler(largest: bool) -> Callable[[torch._ops.OpOverload, tuple, dict], Any]:
    """max.dim / min.dim -> (values, indices); argmax / argmin -> indices (GLOBAL)."""

    def handle(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        a = _bind(op, args, kwargs)
        plan = _plan(a["self"], a["dim"], bool(a["keepdim"]))
        if _needs_no_communication(plan):
            return _run_locally(op, plan, args, kwargs)
        _refuse_complex(op, plan)
        dim = None if a["dim"] is None else plan.dims[0]
        if plan.local.dtype == torch.bool:
            if op.overloadpacket in (aten.argmax, aten.argmin):
                return _run_locally(op, plan, args, kwargs)  # torch refuses bool: let it say so
            plan = dataclasses.replace(plan, local=plan.local.long())
        value, index = _arg_extreme(plan, dim, largest)
        if op.overloadpacket in (aten.argmax, aten.argmin):
            return plan.wrap(index)
        return plan.wrap(value.to(a["self"].dtype)), plan.wrap(index)

    return handle


# ----- logsumexp, norms --------------------------------------------------------------------------------
def _logsumexp(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    a = _bind(op, args, kwargs)
    plan = _plan(a["self"], a["dim"], bool(a["keepdim"]))
    if _needs_no_communication(plan):
        return _run_locally(op, plan, args, kwargs)
    _refuse_complex(op, plan)
    value = torch.logsumexp(plan.local, plan.dims, keepdim=True)  # -inf on an empty shard
    for group in plan.groups:
        value = torch.logsumexp(_gather(value, group), 0)
    return plan.wrap(value)


def _norm_identity(ord: float) -> float:
    """What an empty shard contributes to a norm: 0, or inf for the min-like norms (ord < 0)."""
    return math.inf if ord < 0 else 0.0


def _vector_norm(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    a = _bind(op, args, kwargs)
    plan = _plan(a["self"], a["dim"], bool(a["keepdim"]))
    if _needs_no_communication(plan):
        return _run_locally(op, plan, args, kwargs)
    ord, local = float(a["ord"]), plan.local
    if any(local.shape[d] == 0 for d in plan.dims):
        shape = [1 if d in plan.dims else s for d, s in enumerate(local.shape)]
        dtype = a["dtype"] or (local.real if local.is_complex() else local).dtype
        value = torch.full(shape, _norm_identity(ord), dtype=dtype, device=local.device)
    else:
        value = torch.linalg.vector_norm(local, ord, plan.dims, keepdim=True, dtype=a["dtype"])
    for group in plan.groups:
        gathered = _gather(value, group)
        value = gathered.sum(0) if ord == 0 else torch.linalg.vector_norm(gathered, ord, 0)
    return plan.wrap(value)


# ----- registration ----------------------------------------------------------------------------------
for _op, _handler in (
    (aten.sum.default, _sum),
    (aten.sum.dim_IntList, _sum),
    (aten.nansum.default, _sum),
    (aten.mean.default, _mean),
    (aten.mean.dim, _mean),
    (aten.var.correction, _variance_family),
    (aten.std.correction, _variance_family),
    (aten.var_mean.correction, _variance_family),
    (aten.std_mean.correction, _variance_family),
    (aten.max.default, _extreme_handler(largest=True)),
    (aten.min.default, _extreme_handler(largest=False)),
    (aten.amax.default, _extreme_handler(largest=True)),
    (aten.amin.default, _extreme_handler(largest=False)),
    (aten.aminmax.default, _aminmax),
    (aten.max.dim, _value_index_handler(largest=True)),
    (aten.min.dim, _value_index_handler(largest=False)),
    (aten.argmax.default, _value_index_handler(largest=True)),
    (aten.argmin.default, _value_index_handler(largest=False)),
    (aten.logsumexp.default, _logsumexp),
    (aten.linalg_vector_norm.default, _vector_norm),
):
    ShardTensor.register_dispatch_handler(_op, _handler)
