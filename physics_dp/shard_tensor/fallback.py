"""The fallback for aten ops without a physics_dp handler: DTensor's rules, our data movement.

DTensor's sharding propagator says which placements an op needs and yields; we then
redistribute with explicit sizes, run the op on the slabs, and size the outputs by carrying
the split of the matching input through (a sharded dim of the same extent on the same mesh
axis keeps its split).  Where no input carries a sharded dim of the output's extent (an op that
resizes it: ``pixel_shuffle``), the op runs on meta tensors shaped as each coordinate's slabs,
which every rank can do alone: the split costs no meeting, and it traces.  Only an op whose
output sizes depend on the data, or that has no meta kernel, has its sizes gathered.  Every
output's local shape is checked against its spec, so a rule that does not fit an uneven split
fails loudly instead of mislabelling data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ..distributed import collectives
from . import _dtensor_private as private
from .placements import Partial, Replicate, Shard
from .redistribute import redistribute_local, without_partials
from .shard_tensor import ShardTensor
from .slab_shapes import SlabShapes
from .spec import ShardTensorSpec, balanced_sizes, chunk_sizes, dense_order, in_memory_order

__all__ = ["propagate_and_run", "ShardingRuleError"]


class ShardingRuleError(NotImplementedError):
    """An op has no sharding rule for the given placements."""


def _describe(tensors: list[ShardTensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {list(t._spec.placements)}" for t in tensors)


def _as_shard_tensor(value: Any, mesh) -> ShardTensor | None:
    if isinstance(value, ShardTensor):
        return value
    if isinstance(value, torch.Tensor):
        # Plain tensors meeting a ShardTensor below autograd are replicated values (scalars, masks).
        return ShardTensor(value, ShardTensorSpec(mesh, [Replicate()] * mesh.ndim, value.shape))
    return None


_MEAN = 1  # torch's reduction enum: 'none', 'mean', 'sum'
# Ops whose DTensor rule divides by the global total (``total_weight``), not by the slab's count.
_GLOBAL_MEAN_RULES = frozenset({
    torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss_backward.default,
    torch.ops.aten.nll_loss2d_forward.default, torch.ops.aten.nll_loss2d_backward.default,
})


def _refuse_a_mean_over_slabs(op: torch._ops.OpOverload, args: tuple, kwargs: dict, inputs: list[ShardTensor]) -> None:
    """A loss kernel called with reduction='mean' divides by the count of the tensor it sees: on a
    slab, by the slab's count.  DTensor propagates such ops through their decompositions (so a
    rule exists), but the kernel itself runs here: ``mse_loss_backward`` scaled every gradient by
    the number of ranks, silently.  ``ops/losses.py`` intercepts the ``torch.nn.functional``
    losses; a kernel reached another way raises."""
    names = [a.name for a in op._schema.arguments]
    if "reduction" not in names or op in _GLOBAL_MEAN_RULES:
        return
    at = names.index("reduction")
    reduction = args[at] if at < len(args) else kwargs.get("reduction", op._schema.arguments[at].default_value)
    sharded = [t for t in inputs if any(type(p) is Shard and t._spec.mesh.size(a) > 1 for a, p in enumerate(t._spec.placements))]
    if reduction == _MEAN and sharded:
        raise ShardingRuleError(
            f"{op} averages inside its kernel, which on inputs {_describe(sharded)} would divide by each slab's "
            "count: call the loss with reduction='none' and take .mean() of the result"
        )


def _is_inplace(op: torch._ops.OpOverload) -> bool:
    arguments = op._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _target_specs(inputs: list[ShardTensor], targets: list, chunk_layout: bool) -> list[ShardTensorSpec]:
    """Our specs for DTensor's target placements, with one split per (mesh axis, extent).

    Inputs sharded on the same axis over dims of equal extent must share their split, or a
    broadcasting op would pair unrelated rows; the first input already sharded that way sets
    it.  Ops whose arguments DTensor rewrites into local shapes get the ``torch.chunk`` split
    that rewrite assumes.
    """
    canonical: dict[tuple[int, int], tuple[int, ...]] = {}
    if not chunk_layout:
        for tensor, target in zip(inputs, targets):
            for axis, placement in enumerate(target):
                if type(placement) is Shard and tensor._spec.placements[axis] == placement:
                    key = (axis, tensor.shape[placement.dim])
                    canonical.setdefault(key, tensor._spec.axis_sizes[axis])
    specs = []
    for tensor, target in zip(inputs, targets):
        mesh = tensor._spec.mesh
        if not chunk_layout and tuple(target) == tensor._spec.placements and all(
            type(p) is not Shard or canonical.get((axis, tensor.shape[p.dim])) == tensor._spec.axis_sizes[axis]
            for axis, p in enumerate(target)
        ):
            specs.append(tensor._spec)  # already in place: keep it, memory layout included
            continue
        sizes: list[tuple[int, ...] | None] = []
        for axis, placement in enumerate(target):
            if type(placement) is Shard:
                extent = tensor.shape[placement.dim]
                if chunk_layout:
                    sizes.append(chunk_sizes(extent, mesh.size(axis)))
                else:
                    sizes.append(canonical.setdefault((axis, extent), balanced_sizes(extent, mesh.size(axis))))
            else:
                sizes.append(None)
        specs.append(ShardTensorSpec(mesh, target, tensor.shape, sizes))
    return specs


def _output_spec(
    local: torch.Tensor,
    dspec: Any,
    placements: tuple,
    canonical: dict,
    op,
    inputs,
    slab_shapes: SlabShapes,
    path: tuple[int, ...],
) -> ShardTensorSpec:
    """Our spec for the output DTensor describes as ``dspec``, with its ``placements`` in our terms."""
    mesh = dspec.mesh
    if any(type(p) not in (Shard, Replicate, Partial) for p in placements):
        raise ShardingRuleError(
            f"{op}: DTensor's rule yields placements {placements} on inputs {_describe(inputs)}, which "
            "physics_dp cannot represent; redistribute the inputs (e.g. to Replicate) before this op"
        )
    if dspec.tensor_meta is None:
        raise ShardingRuleError(f"{op}: DTensor's rule gives no output shape for inputs {_describe(inputs)}")
    shape = dspec.tensor_meta.shape
    sizes: list[tuple[int, ...] | None] = []
    for axis, placement in enumerate(placements):
        if type(placement) is Shard:
            extent = shape[placement.dim]
            carried = canonical.get((axis, extent))
            if carried is None:
                carried = slab_shapes.extents(axis, path, placement.dim)
            if carried is None:
                gathered = collectives.gather_sizes([local.shape[placement.dim]], mesh.get_group(axis))
                carried = tuple(g[0] for g in gathered)
            sizes.append(carried)
        else:
            if type(placement) is Partial and placement.reduce_op == "avg":
                uneven = [
                    t for t in inputs if t._spec.axis_sizes[axis] is not None and len(set(t._spec.axis_sizes[axis])) > 1
                ]
                if uneven:
                    raise ShardingRuleError(
                        f"{op}: an average over the uneven split of mesh axis {axis} ({_describe(uneven)}) would "
                        "weight shards wrongly; reduce with sum and divide by the true count"
                    )
            sizes.append(None)
    # DTensor's stride comes from the global shape alone, so every rank builds the same spec
    # (a slab's own strides differ between ranks where its extents are 0 or 1).
    spec = ShardTensorSpec(mesh, placements, shape, sizes, dspec.tensor_meta.stride)
    if spec.local_shape() != local.shape and not _both_empty(local.shape, spec.local_shape()):
        raise RuntimeError(
            f"{op}: the local result has shape {tuple(local.shape)} but its spec {spec} expects "
            f"{tuple(spec.local_shape())} (inputs {_describe(inputs)}); this op needs a physics_dp handler"
        )
    return spec


def propagate_and_run(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    flat_args, args_tree = pytree.tree_flatten(args)
    mesh = next(
        (v._spec.mesh for v in (*flat_args, *kwargs.values()) if isinstance(v, ShardTensor)),
        None,
    )
    inputs: list[ShardTensor] = []
    schema_leaves: list[Any] = []
    for leaf in flat_args:
        tensor = _as_shard_tensor(leaf, mesh)
        if tensor is None:
            schema_leaves.append(leaf)
            continue
        inputs.append(tensor)
        schema_leaves.append(_dtensor_spec(tensor))
    _refuse_a_mean_over_slabs(op, args, kwargs, inputs)
    kwargs_schema = {}
    local_kwargs = {}
    for key, value in kwargs.items():
        tensor = _as_shard_tensor(value, mesh)
        kwargs_schema[key] = value if tensor is None else _dtensor_spec(tensor)
        local_kwargs[key] = value if tensor is None else tensor._local_tensor
    try:
        sharding = private.propagate(op, pytree.tree_unflatten(schema_leaves, args_tree), kwargs_schema)
    except NotImplementedError as error:
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
            return op.decompose(*args, **kwargs)
        raise ShardingRuleError(f"{op} has no sharding rule for inputs {_describe(inputs)}: {error}") from error
    except Exception as error:  # DTensor reports missing strategies in several exception types
        raise ShardingRuleError(f"{op} has no sharding rule for inputs {_describe(inputs)}: {error}") from error

    use_suggested_values = sharding.needs_redistribute and sharding.use_val_from_redistribute_schema
    if sharding.needs_redistribute:
        suggested = sharding.redistribute_schema
        targets = [tuple(s.placements) for s in pytree.tree_leaves(suggested.args_schema) if isinstance(s, private.DTensorSpec)]
    else:
        suggested = None
        targets = [t._spec.placements for t in inputs]
    targets, masked = _replicate_masked_indices(targets, op, inputs)
    specs = _target_specs(inputs, targets, chunk_layout=use_suggested_values)
    if _is_inplace(op) and inputs and specs[0] != inputs[0]._spec:
        raise ShardingRuleError(
            f"in-place {op} would need its destination redistributed ({_describe(inputs[:1])} -> "
            f"{list(specs[0].placements)}); use the out-of-place op"
        )
    locals_ = [
        _in_memory_order_of(redistribute_local(t._local_tensor, t._spec, s), t._spec) for t, s in zip(inputs, specs)
    ]
    masks = _mask_indices(locals_, masked, inputs, targets, specs, op)

    call = op
    local_iter = iter(locals_)
    if use_suggested_values:
        call = suggested.op
        local_args = pytree.tree_map(
            lambda leaf: next(local_iter) if isinstance(leaf, private.DTensorSpec) else leaf, suggested.args_schema
        )
    else:
        local_args = pytree.tree_unflatten(
            [next(local_iter) if isinstance(leaf, torch.Tensor) else leaf for leaf in flat_args], args_tree
        )
    result = call(*local_args, **local_kwargs)
    if _is_inplace(op):
        return args[0]

    canonical: dict[tuple[int, int], tuple[int, ...]] = {}
    for spec in specs:
        for axis, sizes in enumerate(spec.axis_sizes):
            if sizes is not None:
                canonical.setdefault((axis, spec.shape[spec.shard_dim(axis)]), sizes)
    slab_shapes = SlabShapes(op, flat_args, args_tree, specs, kwargs, usable=bool(specs) and not use_suggested_values)
    return _wrap_outputs(result, sharding.output_spec, canonical, op, inputs, slab_shapes, masks)


def _replicate_masked_indices(
    targets: list[tuple], op: torch._ops.OpOverload, inputs: list[ShardTensor]
) -> tuple[list[tuple], dict[int, tuple[int, int, torch.Size]]]:
    """DTensor's targets with each ``_MaskPartial`` index replicated instead, and the masked
    inputs by mesh axis as ``(input, offset_dim, offset_shape)``: ``_mask_indices`` then masks the
    replicated index with our split, which DTensor's mask (on ``torch.chunk``'s) would get wrong."""
    plain, masked = [], {}
    for i, target in enumerate(targets):
        row = []
        for axis, placement in enumerate(target):
            found = private.mask_partial(placement)
            if found is not None:
                if axis in masked:
                    raise ShardingRuleError(
                        f"{op}: DTensor's rule masks two indices on mesh axis {axis} (inputs {_describe(inputs)}); "
                        "redistribute the indices to Replicate before this op"
                    )
                masked[axis] = (i, *found)
            row.append(Replicate() if found is not None else placement)
        plain.append(tuple(row))
    return plain, masked


def _mask_indices(
    locals_: list[torch.Tensor],
    masked: dict[int, tuple[int, int, torch.Size]],
    inputs: list[ShardTensor],
    targets: list[tuple],
    specs: list[ShardTensorSpec],
    op: torch._ops.OpOverload,
) -> dict[int, torch.Tensor]:
    """A masked lookup (``_MaskPartial``): each rank looks up only the rows it holds of the tensor
    the replicated index points into.  The index is shifted by the slab's offset (from our spec, so
    uneven splits hold) and its entries outside the slab point at row 0; the returned masks, by mesh
    axis, say which outputs to zero before they sum over the axis.  ``locals_`` is updated in place."""
    masks = {}
    for axis, (i, dim, shape) in masked.items():
        owner = next(
            (j for j, (t, target) in enumerate(zip(inputs, targets)) if target[axis] == Shard(dim) and t.shape == shape),
            None,
        )
        if owner is None:
            raise ShardingRuleError(
                f"{op}: DTensor's rule masks an index on mesh axis {axis} into no input of shape {tuple(shape)} "
                f"sharded on dim {dim} (inputs {_describe(inputs)}); redistribute the inputs to Replicate first"
            )
        start, size = specs[owner].offsets()[dim], specs[owner].local_shape()[dim]
        mask = (locals_[i] < start) | (locals_[i] >= start + size)
        locals_[i] = (locals_[i] - start).masked_fill(mask, 0)
        if size == 0:  # an empty slab has no row 0: one of zeros stands in, and every output is masked
            locals_[owner] = locals_[owner].new_zeros(locals_[owner].shape[:dim] + (1,) + locals_[owner].shape[dim + 1 :])
        masks[axis] = mask
    return masks


def _settle_private_partials(
    result: torch.Tensor, placements: tuple, masks: dict[int, torch.Tensor], op, inputs
) -> tuple[torch.Tensor, tuple, float | None]:
    """DTensor's private partial outputs in our placements, and the ``p`` of a partial norm.

    A masked lookup's output (``_MaskPartial``) has the entries of masked indices zeroed and sums
    over the axis: ``Partial("sum")``.  A partial p-norm (``_NormPartial``) becomes the
    ``Partial("sum")`` of norm**p, which ``_wrap_outputs`` reduces at once and takes the 1/p power
    of (no later op could carry the power).  Anything else is left for ``_output_spec`` to refuse.
    """
    settled, norm, norm_axes = [], None, []
    for axis, placement in enumerate(placements):
        p = private.norm_partial(placement)
        if private.mask_partial(placement) is not None and axis in masks:
            mask = masks[axis]
            if result.shape[: mask.ndim] != mask.shape:
                raise ShardingRuleError(
                    f"{op}: an output of shape {tuple(result.shape)} does not extend its masked index "
                    f"{tuple(mask.shape)} (inputs {_describe(inputs)}); redistribute the inputs to Replicate first"
                )
            result = result.masked_fill(mask.reshape(*mask.shape, *[1] * (result.ndim - mask.ndim)), 0)
            settled.append(Partial("sum"))
        elif p is not None and norm in (None, p):
            norm = p
            norm_axes.append(axis)
            settled.append(Partial("sum"))
        else:
            settled.append(placement)
    if norm is not None:
        if any(q.is_partial() for axis, q in enumerate(settled) if axis not in norm_axes):
            raise ShardingRuleError(
                f"{op}: DTensor's rule yields a partial {norm}-norm beside another pending reduction "
                f"{tuple(placements)} (inputs {_describe(inputs)}); redistribute the inputs to Replicate first"
            )
        result = result**norm
    return result, tuple(settled), norm


def _in_memory_order_of(local: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    """``local`` laid out in memory in the order of ``spec``'s global strides (a copy only where it is not).

    Some kernels choose their algorithm by the input's layout, and their backward formula asks
    the input again: ``linalg.det`` of a row-major matrix factors its transpose, and its gradient
    then solves with the factors' adjoint only when the input is not row-major.  Run on a slab
    gathered row-major while the wrapper is a transposed view, the gradient took the wrong
    branch, silently.  So the slab a fallback op runs on keeps its wrapper's order.
    """
    if spec.is_contiguous() or not local.numel():
        return local
    order = dense_order(spec.shape, spec.stride)
    return local if order is None else in_memory_order(local, order)  # (overlapping layouts: no order to keep)


def _dtensor_spec(tensor: ShardTensor) -> Any:
    spec = tensor._spec
    return private.make_spec(spec.mesh, spec.placements, spec.shape, spec.stride, tensor.dtype)


def _both_empty(a: torch.Size, b: torch.Size) -> bool:
    return a.numel() == 0 and b.numel() == 0


def _wrap_outputs(
    result: Any,
    output_spec: Any,
    canonical: dict,
    op,
    inputs,
    slab_shapes: SlabShapes,
    masks: dict[int, torch.Tensor],
    path: tuple[int, ...] = (),
) -> Any:
    if output_spec is None:
        return result
    if isinstance(result, torch.Tensor):
        result, placements, norm = _settle_private_partials(result, tuple(output_spec.placements), masks, op, inputs)
        spec = _output_spec(result, output_spec, placements, canonical, op, inputs, slab_shapes, path)
        if result.shape != spec.local_shape():  # an empty slab: some kernels (pixel_shuffle) return it reshaped not at all
            result = result.new_empty(spec.local_shape())
        if (result.dtype is torch.bool and spec.has_partial) or norm is not None:
            # reduced now: a pending logical or / and (any, all), which a later op (a cast to float)
            # would carry on as a sum or a product of numbers; a partial norm's sum of powers, which
            # no later op could take the root of
            resolved = without_partials(spec)
            reduced = redistribute_local(result, spec, resolved)
            return ShardTensor(reduced if norm is None else reduced ** (1 / norm), resolved)
        return ShardTensor(result, spec)
    if isinstance(result, (list, tuple)):
        specs = output_spec if isinstance(output_spec, (list, tuple)) else [output_spec] * len(result)
        wrapped = [
            _wrap_outputs(r, s, canonical, op, inputs, slab_shapes, masks, (*path, i))
            for i, (r, s) in enumerate(zip(result, specs))
        ]
        return type(result)(wrapped)
    return result
