"""Scans (cumsum, cumprod, logcumsumexp, cummax, cummin) and flip over a sharded dim, at the aten level,
with the output sharded.

DTensor's rules for these ops replicate the scanned or reversed dim: every rank then holds, and every
later op computes on, the whole tensor.  Neither op needs that:

- a scan is associative, so each rank scans its slab and then combines into every row the total of
  the ranks before it along the dim (an exclusive scan of the per-rank totals).  A rank's total is
  the last row of its local scan, so one all-gather of those last rows per op (the size of the output
  with the dim removed: ``world - 1`` rows sent per rank) gives every rank its predecessors' totals.
  cummax / cummin send the row's values and global indices together in that one gather;
- a flip over a sharded dim gives rank ``c`` the reversed slab of its mirror ``k - 1 - c``: one
  point-to-point exchange of one slab (none for the middle rank of an odd count).  The output keeps
  the input's placements with the split reversed (identical for even splits); a later op that meets
  a tensor on the original split redistributes as for any two splits.  Flipping dims sharded on
  several mesh axes mirrors every such coordinate in the one exchange.

Empty shards send a filler row that nobody combines (every rank knows the split).  Low precision
scans accumulate in float32 and round once, as torch's kernels do.  Without a sharded scanned or
flipped dim the op runs on the slab.

Backward: every scan that needs a gradient runs as a function-level ``autograd.Function``.  cumsum's
gradient is the reverse (suffix) cumsum of the cotangent ``g``; logcumsumexp's is ``exp(x)`` times the
reverse cumsum of ``g * exp(-y)``, taken in log space as torch's formula does (reverse logcumsumexps of
the positive and negative parts of ``g``).  A reverse scan mirrors the forward: each rank scans its slab
from the end and combines in the total of the ranks after it, the first row of each one's local reverse
scan: one all-gather of one row per rank for cumsum, of two rows (both parts together) for logcumsumexp.
torch's own formulas would reverse through ``flip``, a whole slab sent each way.  cumsum differentiates
any number of times (the reverse cumsum's backward is cumsum).  torch's formulas for cumprod (zero
handling through in-place scatter and gather along the dim) and cummax / cummin (scatter_add into a
global-size zeros tensor) would find no rule or replicate; their backward needs one all-gather of two
rows per rank.  cumprod, logcumsumexp, cummax and cummin refuse a double backward
(``once_differentiable``).  Calls without a gradient, and ops reached below autograd, take the aten
handlers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from ..distributed import collectives
from ..distributed.axis_groups import group_over_axes
from ..shard_tensor import ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import from_local_with_spec, redistribute_to_spec, to_local
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.redistribute import without_partials
from ._local import contiguous_result, gather_rows, slab_as
from .indexing import axis_splitting
from .moments import LOW_PRECISION

__all__: list[str] = []

aten = torch.ops.aten

Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_COMBINE: dict[torch._ops.OpOverload, Combine] = {
    aten.cumsum.default: torch.add,
    aten.cumprod.default: torch.mul,
    aten.logcumsumexp.default: torch.logaddexp,
}


# ----- shared pieces -----------------------------------------------------------------------------
def _last_row(scan: torch.Tensor, dim: int) -> torch.Tensor:
    """The last row along ``dim`` (a rank's total); an empty slab sends a filler nobody combines."""
    n = scan.shape[dim]
    if n:
        return scan.narrow(dim, n - 1, 1)
    return scan.new_zeros([1 if d == dim else s for d, s in enumerate(scan.shape)])


def _first_row(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """The first row along ``dim`` (a rank's total in a reverse scan); an empty slab sends a filler nobody uses."""
    if tensor.shape[dim]:
        return tensor.narrow(dim, 0, 1)
    return tensor.new_zeros([1 if d == dim else s for d, s in enumerate(tensor.shape)])


def _split_at_me(
    spec: ShardTensorSpec, axis: int, rows: Sequence[torch.Tensor]
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Every non-empty rank's ``rows`` along ``axis``, in dim order: those before this rank, those after."""
    if not rows[0].numel():  # another dim is empty: so it is on every rank of the group
        return [], []
    group, members = group_over_axes(spec.mesh, (axis,))
    gathered = gather_rows(rows, group)
    mine = spec.coordinate()[axis]
    sizes = spec.axis_sizes[axis]
    by_coordinate = {member[axis]: piece for member, piece in zip(members, gathered)}
    before = [by_coordinate[c] for c in range(mine) if sizes[c]]
    after = [by_coordinate[c] for c in range(mine + 1, len(sizes)) if sizes[c]]
    return before, after


def _predecessors(spec: ShardTensorSpec, axis: int, rows: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The rows of the non-empty ranks before this one along ``axis``, in dim order."""
    return _split_at_me(spec, axis, rows)[0]


def _successors(spec: ShardTensorSpec, axis: int, rows: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The rows of the non-empty ranks after this one along ``axis``, in dim order."""
    return _split_at_me(spec, axis, rows)[1]


# ----- cumsum, cumprod, logcumsumexp ----------------------------------------------------------------
def _scan_dtype(op: torch._ops.OpOverload, local: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """torch's result dtype: the ``dtype`` argument, else int64 for integral cumsum/cumprod inputs."""
    if dtype is not None:
        return dtype
    if op is not aten.logcumsumexp.default and not (local.is_floating_point() or local.is_complex()):
        return torch.int64
    return local.dtype


def _scan_slab(
    op: torch._ops.OpOverload, local: torch.Tensor, dim: int, dtype: torch.dtype | None, spec: ShardTensorSpec
) -> torch.Tensor:
    """This rank's slab of the global scan: the local scan with the predecessors' total combined in."""
    axis = axis_splitting(spec, dim)
    if axis is None:
        return op(local, dim) if dtype is None else op(local, dim, dtype=dtype)
    out_dtype = _scan_dtype(op, local, dtype)
    work = local.to(out_dtype)
    if out_dtype in LOW_PRECISION:
        work = work.float()  # torch's kernels accumulate low precision in float32
    scan = op(work, dim)
    preceding = _predecessors(spec, axis, [_last_row(scan, dim)])
    if preceding and scan.numel():
        combine = _COMBINE[op]
        carry = functools.reduce(combine, (rows[0] for rows in preceding))
        scan = combine(carry, scan)
    return scan.to(out_dtype)


def _reverse_scan_slab(op: torch._ops.OpOverload, local: torch.Tensor, dim: int, spec: ShardTensorSpec) -> torch.Tensor:
    """This rank's slab of the global reverse (suffix) scan, in ``local``'s dtype: the local reverse scan
    with the successors' total combined in.  A rank's total is the first row of its reverse scan.  The
    flips are local copies; low precision accumulates in float32, as the forward."""
    work = local.float() if local.dtype in LOW_PRECISION else local
    scan = op(work.flip(dim), dim).flip(dim)
    axis = axis_splitting(spec, dim)
    following = _successors(spec, axis, [_first_row(scan, dim)]) if axis is not None else []
    if following and scan.numel():
        combine = _COMBINE[op]
        scan = combine(scan, functools.reduce(combine, (rows[0] for rows in following)))
    return scan.to(local.dtype)


def _scan(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    x, dim = args
    spec = without_partials(x._spec)
    dim %= max(x.ndim, 1)
    return contiguous_result(_scan_slab(op, slab_as(x, spec), dim, kwargs.get("dtype"), spec), spec)


# ----- cummax, cummin ----------------------------------------------------------------------------
Running = tuple[torch.Tensor, torch.Tensor]  # (values, global indices)


def _takes_over(new: torch.Tensor, old: torch.Tensor, is_max: bool) -> torch.Tensor:
    """Where a later running value replaces an earlier one, as torch's kernel decides: a NaN always
    does (the latest NaN wins), else ``>=`` for max and ``<=`` for min (ties go to the later index)."""
    better = new >= old if is_max else new <= old
    return new.isnan() | (~old.isnan() & better)


def _merge(earlier: Running, later: Running, is_max: bool) -> Running:
    """The running (values, indices) of ``earlier`` followed by ``later``."""
    take = _takes_over(later[0], earlier[0], is_max)
    return torch.where(take, later[0], earlier[0]), torch.where(take, later[1], earlier[1])


def _cum_extreme_slab(op: torch._ops.OpOverload, local: torch.Tensor, dim: int, spec: ShardTensorSpec) -> Running:
    """This rank's slab of the global running max/min and its global indices."""
    values, indices = op(local, dim)
    axis = axis_splitting(spec, dim)
    if axis is None:
        return values, indices
    indices = indices + spec.offsets()[dim]
    is_max = op is aten.cummax.default
    preceding = _predecessors(spec, axis, [_last_row(values, dim), _last_row(indices, dim)])
    if preceding and values.numel():
        carry = functools.reduce(lambda a, b: _merge(a, b, is_max), (tuple(rows) for rows in preceding))
        values, indices = _merge(carry, (values, indices), is_max)
    return values, indices


def _cum_extreme(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[ShardTensor, ShardTensor]:
    x, dim = args
    spec = without_partials(x._spec)
    values, indices = _cum_extreme_slab(op, slab_as(x, spec), dim % max(x.ndim, 1), spec)
    return contiguous_result(values, spec), contiguous_result(indices, spec)


# ----- backward of the scans ----------------------------------------------------------------------------
# torch's formulas reverse cumsum and logcumsumexp through flips (a slab each way), scatter into a
# global-size zeros tensor (cummax/cummin) or use in-place scatter / gather along the dim (cumprod's zero
# handling), which would replicate or have no rule.  Their gradients need only one or two rows per rank
# from the others, so they get their own backward.
class _Cumsum(torch.autograd.Function):
    """cumsum on the slab; backward: the reverse cumsum below, so that it differentiates again."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, dim: int, dtype: torch.dtype | None, spec: ShardTensorSpec
    ) -> torch.Tensor:
        ctx.dim, ctx.input_dtype, ctx.spec = dim, local.dtype, spec
        return _scan_slab(aten.cumsum.default, local, dim, dtype, spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # torch casts the cotangent to the input's dtype before the reverse scan
        return _ReverseCumsum.apply(grad.to(ctx.input_dtype), ctx.dim, ctx.spec), None, None, None


class _ReverseCumsum(torch.autograd.Function):
    """The reverse cumsum on the slab (cumsum's gradient): one all-gather of one row per rank.  cumsum is
    linear, so its backward is the cumsum above, and the pair differentiates any number of times."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, spec: ShardTensorSpec) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.spec = dim, spec
        return _reverse_scan_slab(aten.cumsum.default, local, dim, spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _Cumsum.apply(grad, ctx.dim, None, ctx.spec), None, None


class _Logcumsumexp(torch.autograd.Function):
    """logcumsumexp on the slab; backward: one all-gather of two rows per rank (a reverse scan of the
    cotangent's positive and negative parts)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, dim: int, dtype: torch.dtype | None, spec: ShardTensorSpec
    ) -> torch.Tensor:
        result = _scan_slab(aten.logcumsumexp.default, local, dim, dtype, spec)
        ctx.save_for_backward(local, result)
        ctx.dim, ctx.spec = dim, spec
        return result

    @staticmethod
    @once_differentiable  # the reverse logcumsumexp's own gradient is not written: refuse a double backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        local, result = ctx.saved_tensors
        return _logcumsumexp_grad(local, result, grad, ctx.dim, ctx.spec), None, None, None


def _logcumsumexp_grad(
    local: torch.Tensor, result: torch.Tensor, grad: torch.Tensor, dim: int, spec: ShardTensorSpec
) -> torch.Tensor:
    """The input gradient of a sharded logcumsumexp ``y`` of ``x``.

    ``dx_j = sum_{i >= j} g_i exp(x_j - y_i) = exp(x_j + log sum_{i >= j} exp(log g_i - y_i))``: a reverse
    logcumsumexp, which never overflows.  A real cotangent's positive and negative parts (the other part's
    entries at the lowest float, whose exp is 0) are scanned separately, stacked on a new last dim so that
    one gather carries both rows; a complex cotangent's log carries its phase, as in torch's formula.
    """
    x, y, g = (t.float() if t.dtype in LOW_PRECISION else t for t in (local, result, grad))
    op = aten.logcumsumexp.default
    if g.is_complex():
        return (_reverse_scan_slab(op, g.conj().log() - y, dim, spec) + x).exp().conj().to(local.dtype)
    log_abs = g.abs().log()
    lowest = torch.finfo(g.dtype).min
    parts = torch.stack([log_abs.where(g > 0, lowest), log_abs.where(g < 0, lowest)], -1) - y.unsqueeze(-1)
    positive, negative = (_reverse_scan_slab(op, parts, dim, spec) + x.unsqueeze(-1)).exp().unbind(-1)
    return (positive - negative).to(local.dtype)


class _Cumprod(torch.autograd.Function):
    """cumprod on the slab; backward: one all-gather of two rows per rank (slab product, ``sum g * y``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, dim: int, dtype: torch.dtype | None, spec: ShardTensorSpec
    ) -> torch.Tensor:
        ctx.save_for_backward(local)
        ctx.dim, ctx.dtype, ctx.spec = dim, dtype, spec
        return _scan_slab(aten.cumprod.default, local, dim, dtype, spec)

    @staticmethod
    @once_differentiable  # the row gather is not differentiated: refuse a double backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (local,) = ctx.saved_tensors
        return _cumprod_grad(local, grad, ctx.dim, ctx.dtype, ctx.spec), None, None, None


def _cumprod_grad(
    local: torch.Tensor, grad: torch.Tensor, dim: int, dtype: torch.dtype | None, spec: ShardTensorSpec
) -> torch.Tensor:
    """The input gradient of a sharded cumprod, exact with zeros.

    Rank r's outputs are ``P_r * y`` with ``y`` its local cumprod and ``P_r`` the product of the slabs
    before it; a later rank's outputs depend on this slab through its product ``y[-1]`` only.  So the
    gradient is the local cumprod's vector-Jacobian product (torch's own, zeros included) at
    ``conj(P_r) * (g + T_r e_last)``, where ``T_r`` sums the later ranks' ``g * conj(y)``, each scaled by
    the conjugate products of the slabs in between.
    """
    with torch.enable_grad():
        leaf = local.detach().requires_grad_(True)
        scan = aten.cumprod.default(leaf, dim) if dtype is None else aten.cumprod.default(leaf, dim, dtype=dtype)
    axis = axis_splitting(spec, dim)
    cotangent = grad.to(scan.dtype)
    if axis is not None:
        products = _last_row(scan, dim).detach().conj_physical()
        weighted = (cotangent * scan.detach().conj()).sum(dim, keepdim=True)
        before, after = _split_at_me(spec, axis, [products, weighted])
        prefix = functools.reduce(torch.mul, (rows[0] for rows in before), torch.ones_like(products))
        tail = torch.zeros_like(weighted)
        for rows in reversed(after):  # T = t_{r+1} + P_{r+1} (t_{r+2} + P_{r+2} (...))
            tail = rows[1] + rows[0] * tail
        if cotangent.shape[dim]:
            cotangent = cotangent.clone()
            cotangent.narrow(dim, cotangent.shape[dim] - 1, 1).add_(tail)
        cotangent = cotangent * prefix
    if not local.numel():
        return torch.zeros_like(local)
    (result,) = torch.autograd.grad(scan, leaf, cotangent)
    return result


class _CumExtreme(torch.autograd.Function):
    """cummax / cummin on the slab; backward: one all-gather of two rows per rank (the gradient of the
    rows whose extreme comes from an earlier rank, and that extreme's global index)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, op: torch._ops.OpOverload, dim: int, spec: ShardTensorSpec
    ) -> Running:
        values, indices = _cum_extreme_slab(op, local, dim, spec)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.dim, ctx.spec = dim, spec
        return values, indices

    @staticmethod
    @once_differentiable  # the row gather is not differentiated: refuse a double backward
    def backward(ctx, grad: torch.Tensor, _: torch.Tensor):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        return _cum_extreme_grad(grad, indices, ctx.dim, ctx.spec), None, None, None


def _cum_extreme_grad(grad: torch.Tensor, indices: torch.Tensor, dim: int, spec: ShardTensorSpec) -> torch.Tensor:
    """Each output row's gradient goes to the input row its index names (torch's scatter_add).

    Indices never decrease along the dim, so the rows of this slab that name an earlier rank's row form
    a prefix that names one row per column (the extreme carried in): their gradient sum and that index
    are all the other ranks need.
    """
    axis = axis_splitting(spec, dim)
    start = spec.offsets()[dim] if axis is not None else 0
    extent = grad.shape[dim]
    inside = indices >= start
    result = torch.zeros_like(grad)
    result.scatter_add_(dim, (indices - start).clamp_(min=0), grad.where(inside, 0))
    if axis is None:
        return result
    sent = grad.where(~inside, 0).sum(dim, keepdim=True)
    after = _successors(spec, axis, [sent, _first_row(indices, dim)])
    if after and extent:
        owned = [((rows[1] >= start) & (rows[1] < start + extent), rows) for rows in after]
        targets = torch.cat([(rows[1] - start).clamp(0, extent - 1) for _, rows in owned], dim)
        values = torch.cat([rows[0].where(mine, 0) for mine, rows in owned], dim)
        result.scatter_add_(dim, targets, values)
    return result


def _needs_own_backward(x: object, dim: object, kwargs: dict) -> bool:
    """Whether a call gets the backward above: a ShardTensor that needs a gradient, a dim given as an int."""
    return (
        isinstance(x, ShardTensor)
        and isinstance(dim, int)
        and "out" not in kwargs
        and torch.is_grad_enabled()
        and x.requires_grad
    )


def _tensor_and_dim(args: tuple, kwargs: dict) -> tuple[object, object]:
    """``(input, dim)`` of ``torch.cumsum(input, dim)`` or ``input.cumsum(dim)`` (or another scan), given by
    position or name."""
    x = args[0] if args else kwargs.get("input")
    return x, args[1] if len(args) > 1 else kwargs.get("dim")


def _sharded_input(x: ShardTensor, dim: int) -> tuple[torch.Tensor, int, ShardTensorSpec]:
    """The slab (differentiably, Partial axes reduced), the dim made non-negative, and the slab's spec."""
    spec = without_partials(x._spec)
    return to_local(redistribute_to_spec(x, spec)), dim % max(x.ndim, 1), spec


def _scan_function(scan: type[torch.autograd.Function]) -> Callable[[Callable, tuple, tuple, dict], object]:
    """The function-level handler that runs ``scan`` (one of the Functions above) on the slab."""

    def handler(func: Callable, types: tuple, args: tuple, kwargs: dict) -> object:
        x, dim = _tensor_and_dim(args, kwargs)
        if not _needs_own_backward(x, dim, kwargs):
            return run_default(func, args, kwargs)
        local, dim, spec = _sharded_input(x, dim)
        return from_local_with_spec(scan.apply(local, dim, kwargs.get("dtype"), spec), spec)

    return handler


def _cum_extreme_function(func: Callable, types: tuple, args: tuple, kwargs: dict) -> object:
    x, dim = _tensor_and_dim(args, kwargs)
    if not _needs_own_backward(x, dim, kwargs):
        return run_default(func, args, kwargs)
    local, dim, spec = _sharded_input(x, dim)
    is_max = func in (torch.cummax, torch.Tensor.cummax)
    op = aten.cummax.default if is_max else aten.cummin.default
    values, indices = _CumExtreme.apply(local, op, dim, spec)
    result = (from_local_with_spec(values, spec), from_local_with_spec(indices, spec))
    return torch.return_types.cummax(result) if is_max else torch.return_types.cummin(result)


# ----- flip ----------------------------------------------------------------------------------------
def _flip(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    x, dims = args
    spec = without_partials(x._spec)
    dims = sorted({d % max(x.ndim, 1) for d in dims})
    flipped = op(slab_as(x, spec), dims)
    axes = tuple(a for a in (axis_splitting(spec, d) for d in dims) if a is not None)
    if not axes:
        return contiguous_result(flipped, spec)
    axis_sizes = [tuple(reversed(s)) if a in axes else s for a, s in enumerate(spec.axis_sizes)]
    out_spec = ShardTensorSpec(spec.mesh, spec.placements, spec.shape, axis_sizes)
    return contiguous_result(_swap_with_mirror(flipped, spec, out_spec, axes), out_spec)


def _swap_with_mirror(
    flipped: torch.Tensor, spec: ShardTensorSpec, out_spec: ShardTensorSpec, axes: tuple[int, ...]
) -> torch.Tensor:
    """Send this rank's flipped slab to the rank mirrored on ``axes`` and receive that rank's."""
    mine = spec.coordinate()
    mirror = tuple(spec.mesh.size(a) - 1 - c if a in axes else c for a, c in enumerate(mine))
    group, members = group_over_axes(spec.mesh, axes)  # collective on first use: every rank calls it
    if mirror == mine:
        return flipped
    peer = members.index(mirror)
    shapes = {peer: out_spec.local_shape()}
    received = collectives.exchange_with_neighbours(
        {peer: flipped}, shapes, group, dtype=flipped.dtype, device=flipped.device, anchor=flipped
    )
    return received[peer]


for _op, _handler in (
    (aten.cumsum.default, _scan),
    (aten.cumprod.default, _scan),
    (aten.logcumsumexp.default, _scan),
    (aten.cummax.default, _cum_extreme),
    (aten.cummin.default, _cum_extreme),
    (aten.flip.default, _flip),
):
    ShardTensor.register_dispatch_handler(_op, _handler)
for _func, _function_handler in (
    (torch.cumsum, _scan_function(_Cumsum)),
    (torch.Tensor.cumsum, _scan_function(_Cumsum)),
    (torch.logcumsumexp, _scan_function(_Logcumsumexp)),
    (torch.Tensor.logcumsumexp, _scan_function(_Logcumsumexp)),
    (torch.cumprod, _scan_function(_Cumprod)),
    (torch.Tensor.cumprod, _scan_function(_Cumprod)),
    (torch.cummax, _cum_extreme_function),
    (torch.Tensor.cummax, _cum_extreme_function),
    (torch.cummin, _cum_extreme_function),
    (torch.Tensor.cummin, _cum_extreme_function),
):
    ShardTensor.register_function_handler(_func, _function_handler)
