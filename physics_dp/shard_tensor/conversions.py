"""Differentiable conversions between plain tensors, ShardTensors and DTensors.

Gradient convention (docs/architecture.md, "Gradient conventions"): the gradient of a
ShardTensor is the gradient of its *global* value, laid out in its placements with Partial axes
replicated.  ``to_local``'s backward maps a slab's gradient into that form and ``from_local``'s
backward maps it back, so the two are inverse for autograd on every placement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from ..distributed import collectives
from ..distributed.tracing import is_tracing
from .placements import Partial, Placement, Replicate, Shard, StridedShard, normalize_placements
from .redistribute import contiguous_layout, without_partials, redistribute_local
from .shard_tensor import ShardTensor
from .spec import ShardTensorSpec, channels_last_order, chunk_sizes, in_spec_order, laid_out_as

__all__ = [
    "spec_from_local",
    "from_local_with_spec",
    "from_local_exact",
    "function_output",
    "function_input",
    "taken_slab",
    "input_gradient",
    "slab_of",
    "differentiable_slab",
    "slab_gradient",
    "to_local",
    "shared_local",
    "full_tensor",
    "redistribute",
    "redistribute_to_spec",
    "from_dtensor",
    "to_dtensor",
    "replicate_plain",
    "distribute_tensor",
    "keep_grad_layout",
]


def _default_mesh() -> DeviceMesh:
    from ..distributed import DistributedManager

    mesh = DistributedManager().global_mesh
    if mesh is None:
        raise ValueError(
            "no device_mesh given and no global mesh set: pass device_mesh= or call "
            "DistributedManager().initialize_mesh(...) first"
        )
    return mesh


def _check_sizes_agree(sizes: tuple[int, ...], local_extent: int, mesh: DeviceMesh, axis: int) -> None:
    """Collective over ``axis``: every rank was given the same explicit sizes, and each slab has its size.

    One small all-gather; without it ranks given different dicts build different specs, and some
    return while others fail later inside a collective.
    """
    n = mesh.size(axis)
    mine = [len(sizes), local_extent, *(list(sizes) + [-1] * n)[:n]]
    rows = collectives.gather_sizes(mine, mesh.get_group(axis))
    if any(row[0] != rows[0][0] or row[2:] != rows[0][2:] for row in rows):
        given = {coordinate: row[2 : 2 + row[0]] for coordinate, row in enumerate(rows)}
        raise ValueError(f"from_local: the explicit sharding_shapes differ between ranks along mesh axis {axis}: {given}")
    if rows[0][0] != n or any(row[1] != rows[0][2 + c] for c, row in enumerate(rows)):
        slabs = [row[1] for row in rows]
        raise ValueError(
            f"from_local: sharding_shapes gives sizes {list(sizes)} along mesh axis {axis} ({n} ranks) but the slabs "
            f"have {slabs}"
        )


def spec_from_local(
    local: torch.Tensor,
    mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    sharding_shapes: str | dict[int, Sequence[Sequence[int]]],
    global_shape: Sequence[int] | None,
) -> ShardTensorSpec:
    """Work out the global spec of per-rank slabs (see ``ShardTensor.from_local``)."""
    mesh = mesh if mesh is not None else _default_mesh()
    placements = normalize_placements(
        placements if placements is not None else [Replicate()] * mesh.ndim, local.ndim, mesh.ndim
    )
    if sharding_shapes != "chunk" and any(type(p) is StridedShard for p in placements):
        raise ValueError(
            "from_local with StridedShard placements: slab shapes do not tell each factor's split; pass "
            "sharding_shapes='chunk' and global_shape (balanced factors), or flatten a sharded tensor instead"
        )
    shape = list(local.shape)
    axis_sizes: list[tuple[int, ...] | None] = [None] * mesh.ndim
    sharded = [(axis, p.dim) for axis, p in enumerate(placements) if type(p) is Shard]
    if sharding_shapes == "infer":
        for axis, dim in sharded:
            shapes = collectives.gather_sizes(list(local.shape), mesh.get_group(axis))
            for coordinate, other in enumerate(shapes):
                mismatch = [d for d in range(local.ndim) if d != dim and other[d] != local.shape[d]]
                if len(other) != local.ndim or mismatch:
                    raise ValueError(
                        f"from_local: local shapes differ outside the sharded dim {dim} along mesh axis "
                        f"{axis}: this rank has {tuple(local.shape)}, coordinate {coordinate} has {tuple(other)}"
                    )
            axis_sizes[axis] = tuple(s[dim] for s in shapes)
            shape[dim] = sum(axis_sizes[axis])
    elif sharding_shapes == "chunk":
        if global_shape is None:
            raise ValueError('from_local(sharding_shapes="chunk") needs global_shape=')
        shape = list(global_shape)
    elif isinstance(sharding_shapes, dict):
        for axis, dim in sharded:
            if axis not in sharding_shapes:
                raise ValueError(f"sharding_shapes has no entry for sharded mesh axis {axis}")
            axis_sizes[axis] = tuple(int(s[dim]) for s in sharding_shapes[axis])
            if not is_tracing():  # a compiled graph cannot hold this check's data-dependent raise;
                # there only this rank's slab is checked against its size, below
                _check_sizes_agree(axis_sizes[axis], local.shape[dim], mesh, axis)
            shape[dim] = sum(axis_sizes[axis])
    else:
        raise ValueError(f'sharding_shapes must be "infer", "chunk" or a dict, got {sharding_shapes!r}')
    if global_shape is not None and tuple(global_shape) != tuple(shape):
        raise ValueError(f"global_shape {tuple(global_shape)} disagrees with the slabs, which give {tuple(shape)}")
    spec = ShardTensorSpec(mesh, placements, shape, axis_sizes)
    if spec.local_shape() != local.shape:
        raise ValueError(
            f"this rank's slab has shape {tuple(local.shape)} but the spec {spec} expects {tuple(spec.local_shape())}"
        )
    return spec


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    with torch._C.DisableTorchFunctionSubclass():  # a ShardTensor's attribute, read without its __torch_function__ round trip
        return any(t.requires_grad for t in tensors)


def _avg_axes_size(spec: ShardTensorSpec) -> int:
    """How many contributions a ``Partial("avg")`` value averages (product over its avg axes).

    Raises for ``Partial("max")``/``("min")``: which contribution wins is not known here, so a
    gradient through a conversion of such a tensor has no definition.
    """
    count = 1
    for axis, placement in enumerate(spec.placements):
        if type(placement) is Partial:
            if placement.reduce_op == "avg":
                count *= spec.mesh.size(axis)
            elif placement.reduce_op != "sum":
                raise NotImplementedError(
                    f"the gradient of a Partial({placement.reduce_op!r}) tensor's local contribution is not "
                    "defined; reduce the tensor (redistribute to Replicate) before differentiating"
                )
    return count


def slab_gradient(grad: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    """A rank's slab gradient from the global-value gradient of a tensor of ``spec`` (the inverse of
    :func:`_global_value_grad`), differentiably: the gradient may come in another layout, with
    Partial axes, or as a plain tensor of the global shape.

    A plain gradient of the global shape (``y.backward(plain)``, a custom Function's backward or a
    hook returning one) is the replicated value, as plain tensors meeting ShardTensors are
    everywhere; it used to raise a TypeError here, in the middle of the backward pass.
    """
    if not isinstance(grad, ShardTensor):
        if tuple(grad.shape) != tuple(spec.shape):
            raise TypeError(
                f"a plain gradient of shape {tuple(grad.shape)} reached a ShardTensor of global shape "
                f"{tuple(spec.shape)}: pass the gradient as a ShardTensor, or as a plain tensor of the global shape"
            )
        grad = replicate_plain(grad, spec.mesh)
    local = redistribute_to_spec(grad, without_partials(spec)).to_local()
    averaged = _avg_axes_size(spec)
    return local / averaged if averaged != 1 else local


def function_output(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """``local``, the slab of ``spec`` laid out as it says, as the ShardTensor a custom autograd Function returns.

    An op handler whose work is one Function wraps its result inside that Function: the Function's
    node is then the output's ``grad_fn``.  Wrapping after it (:func:`from_local_with_spec`) adds a
    conversion node, which costs tens of microseconds per op forward and again backward with the
    caches cold after the op's kernels.  The Function's backward takes its slab's gradient with
    :func:`slab_gradient`.
    """
    if spec.local_shape() != local.shape or not laid_out_as(local, spec):
        raise RuntimeError(f"local result of shape {tuple(local.shape)} is not laid out as a slab of {spec}: a bug in the op handler")
    return ShardTensor(local, spec)


def function_input(tensor: ShardTensor) -> torch.Tensor:
    """``tensor`` as a custom autograd Function's input: the ShardTensor itself, which the Function's
    forward reads with :func:`taken_slab` and its backward answers with :func:`input_gradient`.

    Why: a slab taken before the Function (:func:`shared_local`) is a conversion node of its own,
    forward and backward (60-80 us of layer norm's forward + backward with the caches cold).  While
    tracing, the slab: a compiled graph traces the conversion's aten ops instead.
    """
    return to_local(tensor) if is_tracing() else tensor


def taken_slab(ctx, value: torch.Tensor) -> torch.Tensor:
    """Inside a Function's forward, the slab of an input passed through :func:`function_input` (noting its spec)."""
    ctx.input_spec = value._spec if isinstance(value, ShardTensor) else None
    return slab_of(value)


def slab_of(value: torch.Tensor) -> torch.Tensor:
    """A ShardTensor's slab, or a plain tensor itself: no autograd edge (a Function's forward and backward)."""
    return value._local_tensor if isinstance(value, ShardTensor) else value


def differentiable_slab(value: torch.Tensor) -> torch.Tensor:
    """A saved Function input's slab for a double backward: through :func:`to_local` for a ShardTensor, so
    that second-order gradients reach the input's producers (:func:`slab_of` would cut them off)."""
    return to_local(value) if isinstance(value, ShardTensor) else value


def input_gradient(ctx, grad: torch.Tensor | None) -> torch.Tensor | None:
    """A Function's gradient for the input read with :func:`taken_slab`, from its slab's gradient:
    the global value's gradient, a ShardTensor, where the input was one."""
    if grad is None or ctx.input_spec is None or isinstance(grad, ShardTensor):
        return grad
    return _global_value_grad(grad, ctx.input_spec)


def _global_value_grad(local_grad: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """The global-value gradient of a tensor of ``spec`` from the gradient of this rank's slab.

    A slab of a Partial axis is a contribution to the pending reduction: the gradient of a sum
    equals its contribution's, that of an average n times it.  The result is laid out in
    ``without_partials(spec)`` (Partial axes replicated).
    """
    averaged = _avg_axes_size(spec)
    local = local_grad if averaged == 1 else local_grad * averaged
    # row-major, as kernels return gradients, except for channels last, whose kernels keep it
    layout = without_partials(spec)
    layout = layout if layout.is_channels_last() else layout.replace()
    # differentiable (from_local), so a double backward (create_graph=True) sees this step
    return from_local_with_spec(local, layout)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:  # type: ignore[override]
        ctx.spec = spec
        return ShardTensor(local, spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None
        return slab_gradient(grad, ctx.spec), None


def from_local_with_spec(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """Wrap ``local`` under ``spec``, a dense layout (row-major or permuted, as channels last), laid
    out as the spec says first (no copy where it already is)."""
    return from_local_exact(in_spec_order(local, spec), spec)


def from_local_exact(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """Wrap ``local`` under ``spec``, whose strides already describe the slab's own (no copy)."""
    if _needs_autograd(local):
        return _FromLocal.apply(local, spec)
    return ShardTensor(local, spec)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: ShardTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = tensor._spec
        # an alias keeps every stride (view_as recomputes those of size-1 dims: a channels-last slab of one
        # sample then read as row-major to torch's layout checks, and its pooling ran row-major)
        return torch.ops.aten.alias(tensor._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _global_value_grad(grad, ctx.spec)


def to_local(tensor: ShardTensor) -> torch.Tensor:
    if _needs_autograd(tensor):
        return _ToLocal.apply(tensor)
    return tensor._local_tensor


# tensor -> (its slab, (the slab's version, its own version) when converted, the view): weak, so an
# entry ends with its tensor
_shared_locals = WeakIdKeyDictionary()


def shared_local(tensor: ShardTensor) -> torch.Tensor:
    """:func:`to_local` for op handlers: one slab view and one autograd node per tensor, shared by
    every op that reads it until it is modified in place.

    Why: the gradients of a tensor that several ops read then meet in the local graph, as plain
    slabs, which autograd adds in place.  With a conversion node per read they met as ShardTensor
    gradients, which autograd adds out of place (never into a tensor subclass), into a new slab per
    extra read (a U-Net decoder block's input, read by its norm and its skip conv).  Not while
    tracing: a compiled graph has its own values and no use for a cache.  Not for leaves: the
    view's graph ends in the leaf's gradient accumulator, which holds the leaf, so the cache
    would keep its own key (and the leaf's slab and gradient) alive for good.
    """
    if not torch.is_grad_enabled() or is_tracing():
        return to_local(tensor)
    with torch._C.DisableTorchFunctionSubclass():  # three autograd attributes, read without three __torch_function__ round trips
        requires_grad, grad_fn, version = tensor.requires_grad, tensor.grad_fn, tensor._version
    if not requires_grad or grad_fn is None:
        return to_local(tensor)
    slab = tensor._local_tensor
    # an in-place write moves one of the two counters: the wrapper's under autograd, else the slab's
    versions = (slab._version, version)
    cached = _shared_locals.get(tensor)
    if cached is not None and cached[0] is slab and cached[1] == versions:
        return cached[2]
    local = _ToLocal.apply(tensor)
    _shared_locals[tensor] = (slab, versions, local)
    return local


def full_tensor(tensor: ShardTensor) -> torch.Tensor:
    spec = tensor._spec
    replicated = ShardTensorSpec(spec.mesh, [Replicate()] * spec.mesh.ndim, spec.shape)
    return to_local(redistribute_to_spec(tensor, replicated))


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: ShardTensor, dst: ShardTensorSpec) -> ShardTensor:  # type: ignore[override]
        ctx.src = tensor._spec
        return ShardTensor(redistribute_local(tensor._local_tensor, tensor._spec, dst), dst)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None
        return redistribute_to_spec(grad, without_partials(ctx.src)), None


def redistribute_to_spec(tensor: ShardTensor, dst: ShardTensorSpec) -> ShardTensor:
    """Differentiable move of ``tensor`` to exactly ``dst`` (placements and sizes)."""
    if tensor._spec == dst:
        return tensor
    if _needs_autograd(tensor):
        return _Redistribute.apply(tensor, dst)
    return ShardTensor(redistribute_local(tensor._local_tensor, tensor._spec, dst), dst)


def without_strided_dims(tensor: ShardTensor) -> ShardTensor:
    """``tensor`` in the nearest layout without strided dims (differentiable; itself if it has none)."""
    return redistribute_to_spec(tensor, contiguous_layout(tensor._spec)) if tensor._spec.strided else tensor


def redistribute(
    tensor: ShardTensor,
    mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    sharding_sizes: dict[int, Sequence[int]] | None = None,
) -> ShardTensor:
    spec = tensor._spec
    if mesh is not None and mesh is not spec.mesh and mesh != spec.mesh:
        raise ValueError("redistribute to a different device mesh is not supported")
    placements = normalize_placements(placements if placements is not None else spec.placements, spec.ndim, spec.mesh.ndim)
    axis_sizes: list[tuple[int, ...] | None] = []
    for axis, placement in enumerate(placements):
        if sharding_sizes is not None and axis in sharding_sizes:
            axis_sizes.append(tuple(sharding_sizes[axis]))
        elif type(placement) is Shard and placement == spec.placements[axis]:
            axis_sizes.append(spec.axis_sizes[axis])  # keep an existing split
        else:
            axis_sizes.append(None)  # balanced default
    return redistribute_to_spec(tensor, ShardTensorSpec(spec.mesh, placements, spec.shape, axis_sizes))


def from_dtensor(dtensor: DTensor) -> ShardTensor:
    """Adopt a DTensor: its implicit ``torch.chunk`` split becomes explicit sizes."""
    mesh = dtensor.device_mesh
    placements = normalize_placements(dtensor.placements, dtensor.ndim, mesh.ndim)
    axis_sizes = [
        chunk_sizes(dtensor.shape[p.dim], mesh.size(axis)) if type(p) is Shard else None
        for axis, p in enumerate(placements)
    ]
    spec = ShardTensorSpec(mesh, placements, dtensor.shape, axis_sizes)
    return from_local_with_spec(dtensor.to_local(), spec)


def to_dtensor(tensor: ShardTensor) -> DTensor:
    """Hand a ShardTensor to DTensor, first moving uneven splits to the chunk layout DTensor assumes."""
    spec = tensor._spec
    if not spec.is_chunk_layout():
        chunked = [
            chunk_sizes(spec.shape[spec.shard_dim(axis)], spec.mesh.size(axis)) if sizes is not None else None
            for axis, sizes in enumerate(spec.axis_sizes)
        ]
        tensor = redistribute_to_spec(tensor, spec.replace(axis_sizes=chunked))
    return DTensor.from_local(
        to_local(tensor), spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )


class _ReplicatePlain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plain: torch.Tensor, mesh: DeviceMesh) -> ShardTensor:  # type: ignore[override]
        spec = ShardTensorSpec(mesh, [Replicate()] * mesh.ndim, plain.shape)
        ctx.spec = spec
        return ShardTensor(plain, spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None
        if isinstance(grad, ShardTensor):
            grad = redistribute_to_spec(grad, ctx.spec).to_local()
        return grad, None


def replicate_plain(plain: torch.Tensor, mesh: DeviceMesh) -> ShardTensor:
    """Treat a plain tensor as replicated on ``mesh``; its gradient is reduced over the mesh once."""
    if _needs_autograd(plain):
        return _ReplicatePlain.apply(plain, mesh)
    return ShardTensor(plain, ShardTensorSpec(mesh, [Replicate()] * mesh.ndim, plain.shape))


def distribute_tensor(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    sharding_sizes: dict[int, Sequence[int]] | None = None,
) -> ShardTensor:
    """Split a tensor that every rank already holds; each keeps its slab, nothing is sent.

    A channels-last tensor gives channels-last slabs (row-major otherwise, whatever its strides).
    Differentiable: the plain tensor's gradient is the gathered global gradient.
    """
    placements = normalize_placements(placements, tensor.ndim, mesh.ndim)
    axis_sizes = [
        tuple(sharding_sizes[axis]) if sharding_sizes is not None and axis in sharding_sizes else None
        for axis in range(mesh.ndim)
    ]
    spec = ShardTensorSpec(mesh, placements, tensor.shape, axis_sizes)
    order = channels_last_order(tensor)
    return redistribute_to_spec(replicate_plain(tensor, mesh), spec if order is None else spec.in_order(order))


class _KeepGradLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: ShardTensor) -> ShardTensor:  # type: ignore[override]
        ctx.target = without_partials(tensor._spec)
        return ShardTensor(tensor._local_tensor, tensor._spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        target = ctx.target
        if not isinstance(grad, ShardTensor):
            return grad  # e.g. the zeros autograd makes up for an op with no gradient (norm of order 0)
        if grad._spec.placements == target.placements and grad._spec.axis_sizes == target.axis_sizes:
            return grad
        return redistribute_to_spec(grad, target.replace())


def keep_grad_layout(tensor: ShardTensor) -> ShardTensor:
    """Identity forward; backward moves the gradient into ``tensor``'s own layout.

    For ops whose backward builds the gradient from a smaller replicated value (a reduction's
    gradient is an expanded scalar): the gradient is cut to the slab right there, so nothing
    upstream (and no leaf's ``.grad``) holds the global extent.  Not for views or in-place ops:
    the result is a new tensor sharing the slab.
    """
    if _needs_autograd(tensor):
        return _KeepGradLayout.apply(tensor)
    return tensor
