"""In-place view ops (``squeeze_``, ``unsqueeze_``, ``transpose_``, ``t_``, ``swapdims_``, ``as_strided_``)
and ``x.data = y``: what changes a ShardTensor's shape or contents in place.

They change a tensor's shape and strides in place, so on a ShardTensor three things must change
together: the slab, the spec (shape, placements) and the wrapper's own metadata.  Run on the slab
alone, as any in-place op is, they left the wrapper and its spec describing the old shape over a
slab of the new one: ``x.unsqueeze_(0)`` on a one-rank mesh reported (2, 3, 7, 5) over a slab of
(1, 2, 3, 7, 5), and the next op computed on the mismatch.

Each runs as its out-of-place view (whose handlers know every layout).  Where that view keeps
each mesh axis's placement kind and split (no data moved: ``transpose_`` of a sharded dim,
``unsqueeze_``, ``squeeze_`` of a whole dim), the tensor takes the view's slab (the same memory,
so other views of it stay aliases) and spec, and the wrapper's metadata is rewritten.  The slab
never takes the op itself: ``squeeze_()`` there would also drop dims that are 1 only in the slab.
A view that moves data (``squeeze_`` of a size-1 dim split over ranks) raises on every rank: the
tensor would have to change its slab under autograd.

``x.data = y`` swapped only the wrapper's metadata, so ``x`` went on computing with its old slab
(silently: ``x + 1`` gave the old values).  Now ``x`` takes ``y``'s slab and spec as well; a
plain ``y`` raises, since it could be the global value or this rank's slab.

As for every tensor subclass, autograd replays views rather than striding them, so a view taken
*before* an in-place view op on its base and written *after* it gets a wrong gradient: torch's
own tensors do the same with view replay on (``torch._C._set_view_replay_enabled``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..shard_tensor import ShardTensor
from ._local import ShardedOpError

__all__: list[str] = []

aten = torch.ops.aten

_OUT_OF_PLACE = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.swapdims_.default: aten.transpose.int,
    aten.swapaxes_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
    aten.as_strided_.default: aten.as_strided.default,
}


def _same_split(view: ShardTensor, tensor: ShardTensor) -> bool:
    """Whether ``view`` keeps, on each mesh axis of several ranks, the kind of placement and the
    split: then its slab is a view of the tensor's (decided from the specs alone, so every rank
    decides alike)."""
    mesh, old, new = tensor.device_mesh, tensor._spec, view._spec
    return all(
        type(old.placements[axis]) is type(new.placements[axis]) and old.axis_sizes[axis] == new.axis_sizes[axis]
        for axis in range(mesh.ndim)
        if mesh.size(axis) > 1
    )


def _in_place_view(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> ShardTensor:
    tensor, rest = args[0], args[1:]
    view = _OUT_OF_PLACE[op](tensor, *rest, **kwargs)
    if not _same_split(view, tensor):
        raise ShardedOpError(
            str(op), [tensor], f"the result is laid out as {list(view.placements)}, which moves data between "
            "ranks; an in-place view cannot change its slab: use the out-of-place op"
        )
    tensor._local_tensor, tensor._spec = view._local_tensor, view._spec
    return return_and_correct_aliasing(op, args, kwargs, tensor)  # rewrites the wrapper's sizes and strides


def _set_data(func: Any, types: tuple, args: tuple, kwargs: dict) -> None:
    """``x.data = y``: the slab, the spec and the wrapper's metadata all become ``y``'s."""
    tensor, value = args
    if not isinstance(value, ShardTensor):
        raise TypeError(
            f"cannot assign a {type(value).__name__} to the .data of a ShardTensor: it could be the global value or "
            "this rank's slab; assign a ShardTensor (physics_dp.shard_tensor.distribute_tensor(value, mesh, placements) or "
            "ShardTensor.from_local(slab, mesh, placements)), or copy values in with x.copy_(...)"
        )
    tensor._local_tensor, tensor._spec = value._local_tensor, value._spec
    with torch._C.DisableTorchFunctionSubclass():
        func(tensor, value)  # the wrapper's own sizes, strides and dtype


for _op in _OUT_OF_PLACE:
    ShardTensor.register_dispatch_handler(_op, _in_place_view, first=True)
ShardTensor.register_function_handler(torch.Tensor.data.__set__, _set_data, every_layout=True)
