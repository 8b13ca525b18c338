"""A whole training run: distributed setup, run directory, data, then each stage of the recipe.

Configuration errors are detected before any collective that depends on them, identically on
every rank, so every rank exits with the same message instead of some hanging.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from ..config import validate
from ..distributed import DistributedManager
from .data_setup import DataBundle, build_data
from .logger import RunLogger, setup_console_logging

__all__ = ["agree_run_dir", "layout", "train"]

log = logging.getLogger(__name__)


def layout(world_size: int, cfg: DictConfig) -> tuple[int, int, int]:
    """(data_size, domain_size, per-rank micro-batch) from the world size and the config."""
    domain = cfg.parallel.domain_size
    if world_size % domain:
        raise ValueError(
            f"parallel.domain_size={domain} does not divide the world size {world_size}; "
            f"choose a divisor of {world_size} (data-parallel size = world size / domain_size)"
        )
    data = world_size // domain
    t = cfg.training
    per_step = data * t.grad_accumulation
    if t.global_batch_size % per_step:
        raise ValueError(
            f"training.global_batch_size={t.global_batch_size} is not divisible by data-parallel size {data} x "
            f"training.grad_accumulation={t.grad_accumulation}; make it a multiple of {per_step}"
        )
    return data, domain, t.global_batch_size // per_step


def agree_run_dir(cfg: DictConfig) -> Path:
    """``run.dir`` if given, else ``<output_root>/<name>/<timestamp>`` chosen by rank 0 for all."""
    choice = [cfg.run.dir or os.path.join(cfg.run.output_root, cfg.run.name, time.strftime("%Y%m%d-%H%M%S"))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]).absolute()


def train(cfg: DictConfig) -> dict:
    """Run every stage of ``cfg.task``; returns per-stage results (losses, validation metrics)."""
    validate(cfg)
    DistributedManager.initialize()
    manager = DistributedManager()
    setup_console_logging(manager.rank)
    data_size, domain_size, per_rank_batch = layout(manager.world_size, cfg)
    mesh = manager.initialize_mesh((data_size, domain_size), ("data", "domain"))
    run_dir = agree_run_dir(cfg)
    if manager.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    log.info("run directory %s; %d data x %d domain ranks", run_dir, data_size, domain_size)
    torch.manual_seed(cfg.training.seed)
    data: DataBundle = build_data(cfg.data, mesh, per_rank_batch, cfg.training.seed)
    logger = RunLogger(
        run_dir,
        mode=cfg.logging.wandb_mode,
        project=cfg.logging.project,
        name=cfg.run.name,
        tags=list(cfg.logging.tags),
        config=OmegaConf.to_container(cfg, resolve=True),
        rank=manager.rank,
    )
    from ..recipes import run_recipe  # recipes sit above the trainer

    try:
        results = run_recipe(cfg, mesh, data, run_dir, logger)
        # Which (rows, cols) windows of each variable this rank read from disk: its rows only.
        results["windows_read"] = {
            group: {var: sorted(windows) for var, windows in counts.windows.items()}
            for group, counts in data.train.read_counts().items()
        }
    finally:
        logger.close()
        data.close()
    return results
