"""Generic EDM diffusion on dataset fields: learn p(state) or p(state | background, invariants)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..config import ModelConfig, SamplingConfig
from ..diffusion import EDMLoss, edm_sampler
from ..models import EDMPrecond, build_backbone
from ..training.task import Task
from .conditioning import Channels, stack_condition

__all__ = ["DiffusionTask"]


class DiffusionTask(Task):
    name = "diffusion"

    def __init__(self, model: ModelConfig, channels: Channels, grid_shape: Sequence[int], sampling: SamplingConfig, channel_weights=None):
        self.model_cfg, self.channels, self.grid_shape = model, channels, tuple(grid_shape)
        self.conditional = bool(model.diffusion.conditional) and channels.forcing > 0
        self.sampling = sampling
        self.channel_weights = channel_weights
        self.edm_loss = EDMLoss(sigma_data=model.diffusion.sigma_data)

    def build_model(self) -> nn.Module:
        arch = self.model_cfg.diffusion.architecture
        net = build_backbone(
            arch,
            grid_shape=self.grid_shape,
            in_channels=self.channels.state,
            out_channels=self.channels.state,
            cond_channels=self.channels.forcing if self.conditional else 0,
            options=dict(self.model_cfg.diffusion[arch]),
        )
        return EDMPrecond(net, sigma_data=self.model_cfg.diffusion.sigma_data)

    def _condition(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        return stack_condition(batch, "background", "invariants") if self.conditional else None

    def loss(self, model, batch, *, seed, sample_ids):
        return self.edm_loss(
            model, batch["target"], condition=self._condition(batch), seed=seed, sample_ids=sample_ids,
            channel_weights=self.channel_weights, mask=batch.get("mask"),
        )

    @torch.no_grad()
    def predict(self, model, batch, *, seed, sample_ids):
        s = self.sampling
        return edm_sampler(
            model, batch["target"], condition=self._condition(batch), seed=seed, sample_ids=sample_ids,
            num_steps=s.num_steps, sigma_min=s.sigma_min, sigma_max=s.sigma_max, rho=s.rho, s_churn=s.s_churn,
        )
