"""Experiments built on the trainer: StormCast (regression, then residual diffusion) and diffusion."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from ..distributed import DistributedManager
from ..nn import sync_module_over_mesh
from ..training.trainer import Trainer, check_grid_fits
from .conditioning import Channels
from .diffusion import DiffusionTask
from .stormcast import RegressionTask, ResidualDiffusionTask, build_regression_model

__all__ = ["Channels", "DiffusionTask", "RegressionTask", "ResidualDiffusionTask", "check_recipe", "load_regression", "run_recipe"]

log = logging.getLogger(__name__)


def _require_regression(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(
            f"the StormCast diffusion stage needs the trained regression model at {path}; train it first "
            "(training.stage=regression or both) or point training.regression_weights at an exported model.pt"
        )


def load_regression(cfg: DictConfig, channels: Channels, grid_shape, path: Path, mesh) -> torch.nn.Module:
    """The frozen stage-1 model from its exported state dict, identical on every rank."""
    _require_regression(path)
    model = build_regression_model(cfg.model, channels, grid_shape)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return sync_module_over_mesh(model.to(DistributedManager().device), mesh)


def _multiple(cfg: DictConfig, stage: str) -> int:
    from ..models import grid_multiple

    if stage == "regression":
        return grid_multiple("unet", dict(cfg.model.regression))
    arch = cfg.model.diffusion.architecture
    return grid_multiple(arch, dict(cfg.model.diffusion[arch]))


def _stages(cfg: DictConfig) -> list[str]:
    if cfg.task == "diffusion":
        return ["diffusion"]
    return ["regression", "diffusion"] if cfg.training.stage == "both" else [cfg.training.stage]


def _regression_weights(cfg: DictConfig, run_dir: Path) -> Path:
    return Path(cfg.training.regression_weights or run_dir / "regression" / "model.pt")


def check_recipe(cfg: DictConfig, data, run_dir: Path) -> None:
    """Everything a recipe needs that can be checked before training starts (and before the run
    directory is written): the grid fits the domain split at every stage, inputs exist."""
    for stage in _stages(cfg):
        check_grid_fits(data.grid_shape[0], cfg.parallel.domain_size, _multiple(cfg, stage))
    if cfg.task == "stormcast" and _stages(cfg) == ["diffusion"]:
        _require_regression(_regression_weights(cfg, run_dir))


def run_recipe(cfg: DictConfig, mesh, data, run_dir: Path, logger) -> dict:
    """Run the stages of ``cfg.task``; each stage trains in ``run_dir/<stage>`` (see ``check_recipe``)."""
    channels = Channels.from_names(data.channel_names)
    grid = data.grid_shape
    weights = list(cfg.training.channel_weights) if cfg.training.channel_weights is not None else None
    results = {}
    for stage in _stages(cfg):
        stage_dir = run_dir / stage
        if cfg.task == "diffusion":
            task = DiffusionTask(cfg.model, channels, grid, cfg.sampling, weights)
        elif stage == "regression":
            task = RegressionTask(cfg.model, channels, grid, weights)
        else:
            regression = load_regression(cfg, channels, grid, _regression_weights(cfg, run_dir), mesh)
            task = ResidualDiffusionTask(cfg.model, channels, grid, regression, cfg.sampling, weights)
        log.info("stage %s: %d steps in %s", stage, cfg.training.max_steps, stage_dir)
        results[stage] = Trainer(cfg, task, mesh, data, stage_dir, logger).fit()
    return results
