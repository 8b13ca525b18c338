"""Loss reductions that are true global means on ShardTensors (and plain means elsewhere).

A sum over a ShardTensor is a global sum, so dividing by the global count of valid points gives
the single-device mean whatever the split: no per-rank weights, no mean of local means.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["masked_mean", "replicated_value"]


def replicated_value(value: torch.Tensor) -> torch.Tensor:
    """The full value of a reduced ShardTensor or DTensor as a plain tensor (plain tensors pass
    through), so callers see one type."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def masked_mean(
    error: torch.Tensor, mask: torch.Tensor | None = None, channel_weights: Sequence[float] | torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of ``error`` (N, C, ...) over valid points (``mask`` True; all when None), channel c
    scaled by ``channel_weights[c]`` (the count is not weighted); 0 when nothing is valid."""
    if channel_weights is not None:
        weights = torch.as_tensor(channel_weights, dtype=error.dtype, device=error.device)
        if weights.shape != (error.shape[1],):
            raise ValueError(
                f"channel_weights must have shape ({error.shape[1]},) (one weight per channel), got {tuple(weights.shape)}"
            )
        error = error * weights.view(1, -1, *([1] * (error.ndim - 2)))
    if mask is None:
        return replicated_value(error.sum()) / error.numel()
    total = replicated_value(torch.where(mask, error, torch.zeros_like(error)).sum())
    count = replicated_value(mask.sum())
    return total / count.clamp_min(1).to(total.dtype)
