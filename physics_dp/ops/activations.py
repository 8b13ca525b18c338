"""``F.prelu`` on sharded activations, as the pointwise ops it is made of.

torch runs prelu as one kernel whose backward (``_prelu_kernel_backward``) returns the input's
gradient together with the weight's, reduced over every other dim: DTensor has no rule for it,
so a sharded prelu raised in backward.  ``where(x > 0, x, weight * x)`` is torch's own definition,
forward and backward (the gradient at 0 follows the weight, as in torch's kernel); each op runs on
the slab, and the weight's gradient is summed over the mesh once, as for any parameter that meets
a sharded tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..shard_tensor import ShardTensor
from ..shard_tensor.dispatch import run_default

__all__: list[str] = []


def _prelu(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    x = args[0] if args else kwargs.get("input")
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    if not isinstance(x, ShardTensor) or not isinstance(weight, torch.Tensor) or x.ndim < 2 or weight.ndim != 1:
        return run_default(func, args, kwargs)
    if weight.numel() not in (1, x.shape[1]):
        return run_default(func, args, kwargs)  # torch's own error for the mismatch
    per_channel = weight.view(-1, *([1] * (x.ndim - 2)))  # broadcasts along dim 1, the channels
    return torch.where(x > 0, x, per_channel * x)


for _func in (F.prelu, torch.prelu):
    ShardTensor.register_function_handler(_func, _prelu)
