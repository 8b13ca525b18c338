"""The ``ShardTensor`` class: a rank's slab of a global tensor, with a spec of the split.

The wrapper is what autograd sees (``.shape``, ``.grad``, ``requires_grad`` are global and
behave as on plain tensors); the slab underneath never requires grad.  Ops reach
``__torch_function__`` first, where registered handlers and a lean pointwise path run before
the dispatcher; everything else reaches ``__torch_dispatch__`` below autograd.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from . import dispatch
from .placements import Placement
from .spec import ShardTensorSpec, in_memory_order, memory_order

__all__ = ["ShardTensor"]


class ShardTensor(torch.Tensor):
    """A ``torch.Tensor`` whose global value is split (possibly unevenly) over a device mesh."""

    _local_tensor: torch.Tensor
    _spec: ShardTensorSpec

    __torch_function__ = classmethod(dispatch.torch_function)  # type: ignore[assignment]
    __torch_dispatch__ = classmethod(dispatch.torch_dispatch)  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: ShardTensorSpec, *, requires_grad: bool = False) -> ShardTensor:
        if local_tensor.requires_grad:
            local_tensor = local_tensor.detach()
        if local_tensor.dtype.is_complex and (local_tensor.is_conj() or local_tensor.is_neg()):
            # the wrapper cannot carry lazy conj/neg bits: materialize them in the slab
            local_tensor = local_tensor.resolve_conj().resolve_neg()
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=spec.stride,
            dtype=local_tensor.dtype,
            device=local_tensor.device,
            requires_grad=requires_grad,
        )
        wrapper._local_tensor = local_tensor
        wrapper._spec = spec
        return wrapper

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ShardTensor(local={self._local_tensor!r}, spec={self._spec!r}, requires_grad={self.requires_grad})"

    # ----- torch.compile: the slab is the one inner tensor, the spec is static metadata --------
    def __tensor_flatten__(self) -> tuple[list[str], ShardTensorSpec]:
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], spec: ShardTensorSpec, outer_size: Any, outer_stride: Any
    ) -> ShardTensor:
        return ShardTensor(inner_tensors["_local_tensor"], spec)

    def _stable_hash_for_caching(self) -> str:
        """AOTAutograd's on-disk cache key for this input: the layout *and this rank's place in it*.

        Ranks of one job share the cache directory, and the graph a rank traces depends on its
        coordinate (which neighbours it exchanges with, which rows it owns); a key without it
        let one rank load another's compiled graph (measured: mismatched collectives, an abort).
        """
        spec = self._spec
        mesh = (spec.mesh.mesh.tolist(), spec.mesh.mesh_dim_names, spec.mesh.device_type, spec.mesh.get_coordinate())
        return repr((mesh, spec.placements, tuple(spec.shape), spec.stride, spec.axis_sizes, str(self.dtype)))

    def __coerce_same_metadata_as_tangent__(self, expected: ShardTensorSpec, expected_type: type | None = None) -> ShardTensor | None:
        """A compiled backward traced its tangent with ``expected``'s layout: match it (memory
        order of the slab, or placements and split through a redistribution)."""
        if expected_type is not None and expected_type is not type(self):
            return None
        if self._spec == expected:
            return self
        same_split = (self._spec.shape, self._spec.placements, self._spec.axis_sizes) == (
            expected.shape, expected.placements, expected.axis_sizes
        )
        if not same_split:
            from .conversions import redistribute_to_spec

            return redistribute_to_spec(self, expected.replace()).__coerce_same_metadata_as_tangent__(expected)
        return ShardTensor(in_memory_order(self._local_tensor, memory_order(expected.stride)), expected)

    def __reduce_ex__(self, protocol: int):  # type: ignore[override]
        raise TypeError(
            "a ShardTensor cannot be pickled (it lives on a device mesh); pickle .full_tensor() or .to_local() instead"
        )

    # ----- properties ----------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def offsets(self) -> tuple[int, ...]:
        """Global index of this rank's slab origin along every tensor dim."""
        return self._spec.offsets()

    # ----- construction --------------------------------------------------------------------
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        sharding_shapes: str | dict[int, Sequence[Sequence[int]]] = "infer",
        global_shape: Sequence[int] | None = None,
    ) -> ShardTensor:
        """Wrap each rank's slab.  Differentiable: the slab's gradient is the matching slab.

        ``sharding_shapes``: ``"infer"`` all-gathers the slab extents of every sharded axis;
        ``"chunk"`` needs ``global_shape`` and assumes the default balanced split; a dict
        ``{mesh_axis: [local shape per coordinate]}`` states the split outright.
        """
        from .conversions import from_local_with_spec, spec_from_local

        if torch.compiler.is_dynamo_compiling():
            layout = (device_mesh, placements, sharding_shapes, global_shape)
            return _from_local_in_graph(local_tensor, dispatch.traced_constant_key(layout))
        spec = spec_from_local(local_tensor, device_mesh, placements, sharding_shapes, global_shape)
        return from_local_with_spec(local_tensor, spec)

    @staticmethod
    def from_dtensor(dtensor: torch.distributed.tensor.DTensor) -> ShardTensor:
        """Adopt a DTensor (its ``torch.chunk`` layout becomes explicit sizes).  Differentiable."""
        from .conversions import from_dtensor

        return from_dtensor(dtensor)

    def to_local(self) -> torch.Tensor:
        """This rank's slab as a plain tensor.  Differentiable."""
        from .conversions import to_local

        return to_local(self)

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank.  Differentiable (gradient taken as replicated)."""
        from .conversions import full_tensor

        return full_tensor(self)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        sharding_sizes: dict[int, Sequence[int]] | None = None,
    ) -> ShardTensor:
        """Change placements (and optionally the split sizes of sharded axes).  Differentiable."""
        from .conversions import redistribute

        return redistribute(self, device_mesh, placements, sharding_sizes)

    def to_dtensor(self) -> torch.distributed.tensor.DTensor:
        """This tensor as a DTensor; only for ``torch.chunk`` layouts, which DTensor understands."""
        from .conversions import to_dtensor

        return to_dtensor(self)

    # ----- registries ----------------------------------------------------------------------
    @staticmethod
    def register_function_handler(
        func: Any, handler: dispatch.FunctionHandler, *, strided: bool = False, every_layout: bool = False
    ) -> None:
        """Route ``func`` (a torch function or method) to ``handler(func, types, args, kwargs)``.

        ``strided=True``: the handler also takes inputs with strided dims (``StridedShard``);
        otherwise they reach it in a contiguous layout.  ``every_layout=True``: the handler also
        takes layouts that need no communication, which otherwise run ``func`` on the slabs (for
        functions that change the ShardTensor itself, such as ``x.data = y``).
        """
        dispatch.register_function_handler(func, handler, strided=strided, every_layout=every_layout)

    @staticmethod
    def register_dispatch_handler(op: torch._ops.OpOverload, handler: dispatch.DispatchHandler, *, first: bool = False) -> None:
        """Route an aten overload to ``handler(op, args, kwargs)`` below autograd.

        ``first=True``: the handler sees every call before any other path (strided inputs, layouts
        that need no communication, the handler registered without it) and returns
        ``NotImplemented`` to leave a call to them: for handlers that know a layout the inputs do
        not show (a select's gradient, told the input's split by its autograd node).
        """
        dispatch.register_dispatch_handler(op, handler, first=first)

    @staticmethod
    def register_strided_handler(op: torch._ops.OpOverload, handler: dispatch.DispatchHandler) -> None:
        """Route an aten overload with an input that has strided dims to ``handler``, which may
        return ``NotImplemented`` to have those inputs take a contiguous layout first."""
        dispatch.register_strided_handler(op, handler)


dispatch.bind_shard_tensor_class(ShardTensor)


@torch.compiler.allow_in_graph
def _from_local_in_graph(local_tensor: torch.Tensor, layout_key: str) -> ShardTensor:
    """``from_local`` inside a compiled function: one call in Dynamo's graph, traced below by
    AOTAutograd (Dynamo cannot build the subclass, nor hold a mesh as a graph argument)."""
    return ShardTensor.from_local(local_tensor, *dispatch.traced_constant(layout_key))

# Libraries that choose a backend from the first component of ``type(x).__module__`` (opt_einsum,
# and tensorly through it) must see a torch tensor, not hand a ShardTensor to NumPy.  The alias
# in ``sys.modules`` keeps ``inspect`` and qualified-name lookups of the class working.
_TORCH_VISIBLE_MODULE = "torch.physics_dp_shard_tensor"
sys.modules.setdefault(_TORCH_VISIBLE_MODULE, sys.modules[__name__])
ShardTensor.__module__ = _TORCH_VISIBLE_MODULE
# Dynamo resolves a class through its module as an attribute path from ``torch``.
setattr(torch, _TORCH_VISIBLE_MODULE.split(".", 1)[1], sys.modules[__name__])
