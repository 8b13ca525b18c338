"""StormCast stage 1: the regression U-Net that predicts the next state. Plain PyTorch.

StormCast (Pathak et al. 2024, km-scale regional weather) first trains a deterministic U-Net to map
the current state, the coarse background forecast and the static invariants to the next state;
a diffusion model then learns the residual.  The regression network is a :class:`SongUNet` that
sees no noise level: its noise labels are fixed at zero, so the embedding is a learned constant.
"""

from __future__ import annotations

import torch
from torch import nn

from .song_unet import SongUNet, SongUNetConfig

__all__ = ["StormCastUNet"]


class StormCastUNet(nn.Module):
    """``forward(state, condition=None) -> (N, out_channels, H, W)``: the predicted next state.

    ``condition`` stacks the background and invariant channels on the state grid
    (``config.cond_channels`` of them); ``state`` has ``config.in_channels``.
    """

    def __init__(self, config: SongUNetConfig | None = None, **overrides):
        super().__init__()
        self.net = SongUNet(config, **overrides)

    @property
    def config(self) -> SongUNetConfig:
        return self.net.config

    def forward(self, state: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        labels = torch.zeros(state.shape[0], dtype=state.dtype, device=state.device)
        return self.net(state, labels, condition)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of parameter elements (only those with ``requires_grad`` if ``trainable_only``)."""
        return self.net.num_parameters(trainable_only)
