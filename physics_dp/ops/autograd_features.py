"""Autograd features that reach ShardTensors through ops of their own.

Forward-mode AD (dual tensors) is refused with a clear error.  It carries a tangent on the
tensor itself, which the function-level paths do not see: the pointwise fast path and the
handlers ran on the slabs and dropped the tangent (measured on one rank: ``unpack_dual(y).tangent``
came back ``None``, a silent wrong derivative), and on several ranks ``make_dual`` failed inside
torch with an unrelated sharding-rule error.  Every
way into forward mode (``torch.autograd.forward_ad.make_dual``, ``torch.func.jvp``, ``jacfwd``,
``hessian``) creates its dual tensors through ``_make_dual``, so refusing it there raises the
same error on every rank, before any communication.
"""

from __future__ import annotations

from typing import Any

import torch

from ..shard_tensor import ShardTensor

__all__ = ["FORWARD_AD_UNSUPPORTED"]

aten = torch.ops.aten

FORWARD_AD_UNSUPPORTED = (
    "forward-mode AD (torch.autograd.forward_ad.make_dual, torch.func.jvp / jacfwd / hessian) is not "
    "supported on ShardTensor: sharded ops do not propagate tangents. Use reverse mode instead: "
    "torch.autograd.grad(..., create_graph=True), torch.func.vjp / grad, or "
    "torch.autograd.functional.jvp (a jvp computed by double backward)"
)


def _refuse_make_dual(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    raise NotImplementedError(FORWARD_AD_UNSUPPORTED)


# every_layout: on one rank the call would otherwise run on the slab, where the tangent is lost
ShardTensor.register_function_handler(torch._C._VariableFunctions._make_dual, _refuse_make_dual, every_layout=True)


def _any_or_all(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``_is_any_true`` / ``_is_all_true``: the checks of ``detect_anomaly(check_nan=True)`` on
    every gradient (and of ``torch._assert_async``).  DTensor has no rule for them, so anomaly
    mode raised a ShardingRuleError; they are ``any`` / ``all`` of a bool tensor, which reduce
    over the whole mesh and answer the same on every rank."""
    reduce = aten.any.default if op is aten._is_any_true.default else aten.all.default
    return reduce(*args, **kwargs)


for _op in (aten._is_any_true.default, aten._is_all_true.default):
    ShardTensor.register_dispatch_handler(_op, _any_or_all)
