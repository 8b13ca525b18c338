"""``F.linear`` and ``x @ W`` on tensors sharded over leading (token, batch, spatial) dims.

A linear map acts on the last dim only, so when that dim is whole on every rank each slab is
mapped on its own, with no communication; only the weight gradient needs summing over the
sharded axes (``local_param``).  Without this, the aten decomposition flattens leading dims
into one, which for a sharded dim that is not the leading one forces a gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..shard_tensor import Partial, Shard, ShardTensor
from ..shard_tensor.dispatch import run_default
from ._local import local_input, local_param, wrap_local

__all__ = ["sharded_linear"]


def _shared(t: Any) -> bool:
    """A parameter every rank holds whole: plain, or a replicated ShardTensor."""
    if isinstance(t, ShardTensor):
        return all(p.is_replicate() for p in t.placements)
    return t is None or isinstance(t, torch.Tensor)


def _acts_locally(x: Any, weight: Any, bias: Any = None) -> bool:
    """True when ``x`` is sharded only on leading dims and the parameters are shared by every rank."""
    if not isinstance(x, ShardTensor) or x.ndim < 2 or weight is None:
        return False
    if any(type(p) is Partial or (type(p) is Shard and p.dim == x.ndim - 1) for p in x.placements):
        return False
    return _shared(weight) and _shared(bias)


def sharded_linear(x: ShardTensor, weight: torch.Tensor, bias: torch.Tensor | None) -> ShardTensor:
    local = F.linear(local_input(x), local_param(weight, x), local_param(bias, x))
    shape = (*x.shape[:-1], local.shape[-1])
    return wrap_local(local, x, shape, x._spec.axis_sizes)


def _linear_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if _acts_locally(x, weight, bias):
        return sharded_linear(x, weight, bias)
    return run_default(func, args, kwargs)


def _matmul_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    x, other = args[0], args[1]
    if not kwargs and _acts_locally(x, other) and other.ndim == 2:
        return sharded_linear(x, other.t(), None)
    return run_default(func, args, kwargs)


ShardTensor.register_function_handler(F.linear, _linear_handler)
for _func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
    ShardTensor.register_function_handler(_func, _matmul_handler)
