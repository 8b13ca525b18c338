"""A finished training run, reopened for inference: its config and its exported models.

Why the typed schema again: ``config.yaml`` is plain YAML, and merging it into the training
schema checks old runs and command-line overrides exactly as ``physics_dp.train`` would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from ..config import TrainConfig, validate
from ..models import grid_multiple
from ..nn import compile_in_place
from ..recipes import Channels, DiffusionTask, RegressionTask, ResidualDiffusionTask
from ..training.task import Task
from ..training.trainer import check_grid_fits

__all__ = ["Predictor", "load_predictor", "load_run_config"]


def load_run_config(run_dir: Path, overrides: Sequence[str] = ()) -> DictConfig:
    """The run's resolved training config with ``overrides`` (``section.key=value``) applied."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; run_dir must be a directory written by physics_dp.train")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as error:
        raise ValueError(f"{path} with overrides {list(overrides)} does not fit the training schema: {error}") from None
    validate(cfg)
    return cfg  # type: ignore[return-value]


def _load(model: nn.Module, path: Path, device: torch.device, compile_backend: str | None) -> nn.Module:
    try:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except RuntimeError as error:
        raise ValueError(f"{path} does not fit the model the run's config.yaml builds (was the config edited?): {error}") from None
    model = model.eval().requires_grad_(False).to(device)
    return compile_in_place(model, compile_backend) if compile_backend else model


def _compile_backend(cfg: DictConfig) -> str | None:
    """``training.compile`` of the run (or of an override): inference compiles as training did."""
    training = cfg.training
    return training.get("compile_backend", "inductor") if training.get("compile", False) else None


@dataclass
class Predictor:
    """One forecast step: ``task.predict(model, batch)`` gives the next state (or a sample of it).

    ``stochastic`` says whether members differ (a diffusion model draws them); ``rolls_out`` whether
    the prediction becomes the next step's state (StormCast) or each time stands alone (diffusion).
    """

    task: Task
    model: nn.Module
    stochastic: bool
    rolls_out: bool

    def predict(self, batch: dict[str, torch.Tensor], seed: int, sample_ids: torch.Tensor) -> torch.Tensor:
        return self.task.predict(self.model, batch, seed=seed, sample_ids=sample_ids)


def load_predictor(
    cfg: DictConfig, run_dir: Path, channels: Channels, grid: tuple[int, int], domain_size: int, device: torch.device | str = "cpu"
) -> Predictor:
    """The recipe's forecaster with the run's exported weights, identical on every rank.

    StormCast: regression mean plus a diffusion residual when ``diffusion/model.pt`` exists, else the
    regression alone. Diffusion recipe: the (conditional or unconditional) diffusion model.
    """
    run_dir, device, backend = Path(run_dir), torch.device(device), _compile_backend(cfg)
    diffusion_path = run_dir / "diffusion" / "model.pt"
    arch = cfg.model.diffusion.architecture
    diffusion_multiple = grid_multiple(arch, dict(cfg.model.diffusion[arch]))
    if cfg.task == "diffusion":
        if not diffusion_path.is_file():
            raise FileNotFoundError(f"{diffusion_path} does not exist; the diffusion recipe's training did not finish exporting it")
        check_grid_fits(grid[0], domain_size, diffusion_multiple)
        task = DiffusionTask(cfg.model, channels, grid, cfg.sampling)
        return Predictor(task, _load(task.build_model(), diffusion_path, device, backend), stochastic=True, rolls_out=False)
    regression_path = Path(cfg.training.regression_weights or run_dir / "regression" / "model.pt")
    if not regression_path.is_file():
        raise FileNotFoundError(
            f"{regression_path} does not exist; StormCast inference needs the regression model (train with "
            "training.stage=regression or both)"
        )
    check_grid_fits(grid[0], domain_size, grid_multiple("unet", dict(cfg.model.regression)))
    regression = RegressionTask(cfg.model, channels, grid)
    regression_model = _load(regression.build_model(), regression_path, device, backend)
    if not diffusion_path.is_file():
        return Predictor(regression, regression_model, stochastic=False, rolls_out=True)
    check_grid_fits(grid[0], domain_size, diffusion_multiple)
    residual = ResidualDiffusionTask(cfg.model, channels, grid, regression_model, cfg.sampling)
    return Predictor(residual, _load(residual.build_model(), diffusion_path, device, backend), stochastic=True, rolls_out=True)
