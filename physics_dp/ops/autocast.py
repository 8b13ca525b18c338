"""Autocast for function handlers, which see their inputs above it (autocast casts below ``__torch_function__``).

A handler that runs torch's own ops on the slabs gets autocast's casts from them.  One that calls
kernels autocast does not list (the halo convolutions' and the ring's autograd Functions, the
norms' statistics kernels) casts its inputs itself, as torch's op would have been handed them:

- :func:`lower_precision`: convolution and attention run in the autocast dtype (fp32 inputs are
  cast; fp64 stays, as autocast leaves it);
- :func:`fp32_where_autocast_does`: an op that autocast runs in fp32 on this device (CUDA's policy
  does for group and layer norm, CPU's does not) gets an fp32 input, so its output has torch's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..distributed.tracing import outside_trace
from .moments import LOW_PRECISION

__all__ = ["lower_precision", "fp32_where_autocast_does"]


def lower_precision(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Under autocast on the first tensor's device, its fp32 tensors in the autocast dtype (None passes)."""
    if not torch._C._is_any_autocast_enabled():  # the common case, without reading the tensors' metadata
        return tensors
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t
        for t in tensors
    )


def fp32_where_autocast_does(x: torch.Tensor, probe: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x`` in fp32 when autocast is on and runs the op that ``probe`` calls in fp32 for ``x``'s dtype."""
    if not torch._C._is_any_autocast_enabled():  # no metadata read (a ShardTensor's goes through __torch_function__)
        return x
    device = x.device.type
    if x.dtype in LOW_PRECISION and torch.is_autocast_enabled(device):
        if _runs_in_fp32(probe, device, torch.get_autocast_dtype(device), x.dtype):
            return x.float()
    return x


@functools.lru_cache(maxsize=None)
def _runs_in_fp32(probe: Callable[[torch.Tensor], torch.Tensor], device_type: str, autocast_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """torch's own answer, once per op and dtypes, on a (1, 2, 2) tensor outside any trace: the
    policy tables differ between devices and releases."""
    with outside_trace(), torch.autocast(device_type, dtype=autocast_dtype):
        return probe(torch.ones(1, 2, 2, dtype=dtype, device=device_type)).dtype == torch.float32
