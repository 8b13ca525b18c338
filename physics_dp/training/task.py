"""What a training stage computes, separated from how the trainer runs it.

A task builds its model from the data's channels and grid, turns a sharded batch into a loss, and
predicts fields for validation.  The trainer owns everything else (mesh, data parallelism,
optimizer, checkpoints, logging), so StormCast's two stages and generic diffusion share one loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import torch
from torch import nn

from ..nn.losses import masked_mean

__all__ = ["Task", "masked_mean"]


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
