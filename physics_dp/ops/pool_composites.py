"""``F.lp_pool1d/2d/3d`` and ``F.local_response_norm`` on sharded tensors, through the sharded pools.

Both are Python composites of torch's pooling functions.  A composite without a handler runs as
torch's own code with torch functions turned off (``run_default``), so the pools inside it never
reached the sharded pooling and fell to DTensor's rules, which have none for the pools' backward:
both raised in backward.  Here each is written out from its definition with the
``torch.nn.functional`` pools, which dispatch to ``ops/pooling.py`` (halo rows only where a window
crosses a split).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..shard_tensor import ShardTensor
from ..shard_tensor.dispatch import run_default
from ._args import bind, per_dim

__all__: list[str] = []

_LP_POOLS = {F.lp_pool1d: 1, F.lp_pool2d: 2, F.lp_pool3d: 3}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _lp_pool(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """The p-norm of each window: (sum over the window of x ** p) ** (1 / p), the sum as an average
    times the window's size (torch's definition, sign of the sum kept); p = +-inf: max of |x| (min)."""
    bound = bind(("input", "norm_type", "kernel_size", "stride", "ceil_mode"), args, kwargs, {"stride": None, "ceil_mode": False})
    x, p, kernel, stride, ceil_mode = (bound[k] for k in ("input", "norm_type", "kernel_size", "stride", "ceil_mode"))
    nd = _LP_POOLS[func]
    if not isinstance(x, ShardTensor) or not isinstance(p, (int, float)):
        return run_default(func, args, kwargs)
    stride = kernel if stride is None else stride
    if math.isinf(p):
        largest = _MAX[nd](x.abs() if p > 0 else -x.abs(), kernel, stride, 0, 1, ceil_mode)
        return largest if p > 0 else -largest
    sums = _AVG[nd](x.pow(p), kernel, stride, 0, ceil_mode)
    return (torch.sign(sums) * F.relu(sums.abs())).mul(math.prod(per_dim(kernel, nd))).pow(1.0 / p)


def _local_response_norm(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """x / (k + alpha * mean of x ** 2 over ``size`` neighbouring channels) ** beta: the channel window
    is an average pool over the channel dim of a (N, 1, C, ...) view, zero-padded as torch pads it."""
    bound = bind(("input", "size", "alpha", "beta", "k"), args, kwargs, {"alpha": 1e-4, "beta": 0.75, "k": 1.0})
    x, size = bound["input"], bound["size"]
    if not isinstance(x, ShardTensor) or x.ndim < 3 or x.numel() == 0:
        return run_default(func, args, kwargs)  # torch's own error, or its empty result
    squares = (x * x).unsqueeze(1)  # (N, 1, C, ...): the channels become a pooled dim
    if x.ndim > 4:
        squares = squares.flatten(4)  # (N, 1, C, H, W * ...): a 3-D pool covers any trailing dims
    pads = [0, 0] * (squares.ndim - 3) + [size // 2, (size - 1) // 2]
    window = (size,) + (1,) * (squares.ndim - 3)
    pool = F.avg_pool2d if squares.ndim == 4 else F.avg_pool3d
    mean = pool(F.pad(squares, pads), window, stride=1).squeeze(1).view(x.shape)
    return x / mean.mul(bound["alpha"]).add(bound["k"]).pow(bound["beta"])


for _func in _LP_POOLS:
    ShardTensor.register_function_handler(_func, _lp_pool)
ShardTensor.register_function_handler(F.local_response_norm, _local_response_norm)
