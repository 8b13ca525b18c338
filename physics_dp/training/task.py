"""What a training stage computes, separated from how the trainer runs it.

A task builds its model from the data's channels and grid, turns a sharded batch into a loss, and
predicts fields for validation.  The trainer owns everything else (mesh, data parallelism,
optimizer, checkpoints, logging), so StormCast's two stages and generic diffusion share one loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Task", "masked_mean"]


def masked_mean(error: torch.Tensor, mask: torch.Tensor | None = None, channel_weights: Sequence[float] | None = None) -> torch.Tensor:
    """Mean of ``error`` (N, C, H, W) over valid points (``mask`` True), each channel scaled by its
    weight; a true global mean on ShardTensors (global sums, global counts)."""
    if channel_weights is not None:
        weights = torch.as_tensor(list(channel_weights), dtype=error.dtype, device=error.device)
        if weights.shape != (error.shape[1],):
            raise ValueError(f"training.channel_weights has {weights.numel()} entries for {error.shape[1]} state channels")
        error = error * weights.view(1, -1, 1, 1)
    if mask is None:
        total = error.sum()
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        return total / error.numel()
    total = torch.where(mask, error, torch.zeros_like(error)).sum()
    count = mask.sum()
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    count = count.full_tensor() if hasattr(count, "full_tensor") else count
    return total / count.clamp_min(1).to(total.dtype)


class Task(ABC):
    """One training stage: ``name`` is also its sub-directory of the run directory."""

    name: str

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The plain-PyTorch model to train (identical on every rank for the same seed)."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], *, seed: int, sample_ids: torch.Tensor) -> torch.Tensor:
        """This data replica's mean loss (a plain 0-d tensor) on a sharded batch."""

    @abstractmethod
    def predict(self, model: nn.Module, batch: dict[str, torch.Tensor], *, seed: int, sample_ids: torch.Tensor) -> torch.Tensor:
        """The model's estimate of ``batch["target"]`` (same layout), without gradients."""
