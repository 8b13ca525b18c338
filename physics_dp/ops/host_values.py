"""Answers about a whole ShardTensor as Python values: ``torch.equal``, ``torch.allclose``, ``Tensor.tolist``.

Each rank holds a slab, but these answers are about the global tensor, so every rank must get
the same one (a rank that goes on with another answer leaves its peers in the next
collective).  They are built from sharded ops that already reduce over the mesh:

- ``equal``: the global shapes, then ``(a == b).all()``.  torch's aten op is tagged pointwise,
  so on the slabs each rank answered for its own slab (and the wrapper then failed on a bool).
- ``allclose``: ``isclose(...).all()`` (DTensor has no rule: it raised).
- ``tolist``: the global value's list, from ``full_tensor()`` (torch refuses subclasses).
- ``numpy``: raises, naming both meanings: an array would not share the tensor's memory as
  torch's does, so a copy of the global value or the slab has to be asked for by name.

All of them are collective: every rank of the mesh calls them, as it calls ``item()``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..shard_tensor import ShardTensor

__all__: list[str] = []


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return bool((a == b).all())


def _equal_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> bool:
    return _equal(*args, **kwargs)


def _equal_aten(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    return _equal(*args, **kwargs)


def _allclose(
    input: torch.Tensor, other: torch.Tensor, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False
) -> bool:
    return bool(torch.isclose(input, other, rtol=rtol, atol=atol, equal_nan=equal_nan).all())


def _allclose_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> bool:
    return _allclose(*args, **kwargs)


def _tolist_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    return args[0].full_tensor().detach().tolist()


def _numpy_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    raise TypeError(
        "a ShardTensor has no NumPy view of its memory (its value is split over ranks): use "
        "x.full_tensor().numpy() for a copy of the global value (every rank must call it), or "
        "x.to_local().numpy() for this rank's slab"
    )


for _func in (torch.equal, torch.Tensor.equal):
    ShardTensor.register_function_handler(_func, _equal_handler, every_layout=True)
for _func in (torch.allclose, torch.Tensor.allclose):
    ShardTensor.register_function_handler(_func, _allclose_handler, every_layout=True)
ShardTensor.register_function_handler(torch.Tensor.tolist, _tolist_handler, every_layout=True)
ShardTensor.register_function_handler(torch.Tensor.numpy, _numpy_handler, every_layout=True)
ShardTensor.register_dispatch_handler(torch.ops.aten.equal.default, _equal_aten, first=True)
