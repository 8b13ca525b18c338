"""StormCast (Pathak et al. 2024): a regression U-Net, then EDM diffusion on its residual.

Stage 1 learns the next state from the current state, the coarse background and the static
invariants.  Stage 2 freezes that network and trains an EDM model on ``target - regression``,
conditioned on the state, the regression mean, the background and the invariants; a forecast is
the regression mean plus a diffusion sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..config import ModelConfig, SamplingConfig
from ..diffusion import EDMLoss, edm_sampler
from ..models import EDMPrecond, build_backbone, build_regression_unet
from ..training.task import Task, masked_mean
from .conditioning import Channels, stack_condition

__all__ = ["RegressionTask", "ResidualDiffusionTask", "build_regression_model", "build_residual_diffusion_model", "regression_mean"]


def build_regression_model(model: ModelConfig, channels: Channels, grid_shape: Sequence[int]) -> nn.Module:
    return build_regression_unet(
        grid_shape=grid_shape,
        in_channels=channels.state,
        out_channels=channels.state,
        cond_channels=channels.forcing,
        options=dict(model.regression),
    )


def build_residual_diffusion_model(model: ModelConfig, channels: Channels, grid_shape: Sequence[int]) -> EDMPrecond:
    arch = model.diffusion.architecture
    net = build_backbone(
        arch,
        grid_shape=grid_shape,
        in_channels=channels.state,
        out_channels=channels.state,
        cond_channels=2 * channels.state + channels.forcing,
        options=dict(model.diffusion[arch]),
    )
    return EDMPrecond(net, sigma_data=model.diffusion.sigma_data)


def regression_mean(regression: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Stage 1's forecast of ``target`` from the batch."""
    return regression(batch["state"], stack_condition(batch, "background", "invariants"))


class RegressionTask(Task):
    name = "regression"

    def __init__(self, model: ModelConfig, channels: Channels, grid_shape: Sequence[int], channel_weights=None):
        self.model_cfg, self.channels, self.grid_shape = model, channels, tuple(grid_shape)
        self.channel_weights = channel_weights

    def build_model(self) -> nn.Module:
        return build_regression_model(self.model_cfg, self.channels, self.grid_shape)

    def loss(self, model, batch, *, seed, sample_ids):
        error = (regression_mean(model, batch) - batch["target"]) ** 2
        return masked_mean(error, batch.get("mask"), self.channel_weights)

    @torch.no_grad()
    def predict(self, model, batch, *, seed, sample_ids):
        return regression_mean(model, batch)


class ResidualDiffusionTask(Task):
    """Stage 2: EDM on the residual of a frozen regression model (plain module, synced over ranks)."""

    name = "diffusion"

    def __init__(
        self,
        model: ModelConfig,
        channels: Channels,
        grid_shape: Sequence[int],
        regression: nn.Module,
        sampling: SamplingConfig,
        channel_weights=None,
    ):
        self.model_cfg, self.channels, self.grid_shape = model, channels, tuple(grid_shape)
        self.regression = regression.eval().requires_grad_(False)
        self.sampling = sampling
        self.channel_weights = channel_weights
        self.edm_loss = EDMLoss(sigma_data=model.diffusion.sigma_data)

    def build_model(self) -> nn.Module:
        return build_residual_diffusion_model(self.model_cfg, self.channels, self.grid_shape)

    def _mean_and_condition(self, batch):
        with torch.no_grad():
            mean = regression_mean(self.regression, batch)
        condition = torch.cat([batch["state"], mean, *(batch[k] for k in ("background", "invariants") if k in batch)], dim=1)
        return mean, condition

    def loss(self, model, batch, *, seed, sample_ids):
        mean, condition = self._mean_and_condition(batch)
        residual = batch["target"] - mean
        return self.edm_loss(
            model,
            residual,
            condition=condition,
            seed=seed,
            sample_ids=sample_ids,
            channel_weights=self.channel_weights,
            mask=batch.get("mask"),
        )

    @torch.no_grad()
    def predict(self, model, batch, *, seed, sample_ids):
        mean, condition = self._mean_and_condition(batch)
        s = self.sampling
        residual = edm_sampler(
            model,
            mean,
            condition=condition,
            seed=seed,
            sample_ids=sample_ids,
            num_steps=s.num_steps,
            sigma_min=s.sigma_min,
            sigma_max=s.sigma_max,
            rho=s.rho,
            s_churn=s.s_churn,
        )
        return mean + residual
