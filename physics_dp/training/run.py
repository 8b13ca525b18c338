"""A whole training run: distributed setup, run directory, data, then each stage of the recipe.

Configuration errors are detected before any collective that depends on them, identically on
every rank, so every rank exits with the same message instead of some hanging. Work only rank 0
does (the run directory, statistics, the logger) fails as the same error on every rank, and
nothing is written into the run directory before every check has passed (docs/reliability.md).
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
from ..distributed.agreement import on_rank0, raise_together
from ..distributed.host_memory import keep_freed_memory
from ..distributed.watchdog import Watchdog
from .data_setup import DataBundle, build_data
from .logger import RunLogger, setup_console_logging
from .run_dir import RunDirectory

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


def _explain_timeout(error: BaseException, timeout_s: float) -> None:
    """Say what a collective that waited past ``parallel.timeout_s`` usually means."""
    text = str(error).lower()
    if isinstance(error, (RuntimeError, dist.DistError)) and ("timed out" in text or "timeout" in text):
        error.add_note(
            f"A collective waited longer than parallel.timeout_s={timeout_s:g} s on rank {DistributedManager().rank}: another rank is "
            "stalled or was lost, or not every rank called the same collective (e.g. full_tensor() under `if rank == 0`). "
            "Raise parallel.timeout_s only if a rank legitimately needs longer between collectives."
        )


def train(cfg: DictConfig) -> dict:
    """Run every stage of ``cfg.task``; returns per-stage results (losses, validation metrics).

    Order: every check that needs no files first (config values, layout), then the run directory
    is claimed (lock, comparison with an existing run), the data and the stages are checked, and
    only then is ``config.yaml`` written and training started.
    """
    validate(cfg)
    if cfg.training.keep_freed_memory:
        keep_freed_memory()
    DistributedManager.initialize(timeout=cfg.parallel.timeout_s)
    manager = DistributedManager()
    setup_console_logging(manager.rank)
    data_size, domain_size, per_rank_batch = layout(manager.world_size, cfg)
    mesh = manager.initialize_mesh((data_size, domain_size), ("data", "domain"))
    directory = RunDirectory(agree_run_dir(cfg), cfg)
    on_rank0(directory.claim)
    try:
        with Watchdog(cfg.parallel.timeout_s):
            return _train_in(directory, cfg, mesh, per_rank_batch, data_size, domain_size)
    except Exception as error:
        _explain_timeout(error, cfg.parallel.timeout_s)
        raise
    finally:
        directory.release()


def _train_in(directory: RunDirectory, cfg: DictConfig, mesh, per_rank_batch: int, data_size: int, domain_size: int) -> dict:
    from ..recipes import check_recipe, run_recipe  # recipes sit above the trainer

    run_dir = directory.path
    log.info("run directory %s; %d data x %d domain ranks", run_dir, data_size, domain_size)
    torch.manual_seed(cfg.training.seed)
    data: DataBundle = build_data(cfg.data, mesh, per_rank_batch, cfg.training.seed, cfg.training.grad_accumulation)
    try:
        failure: Exception | None = None
        try:
            check_recipe(cfg, data, run_dir)
        except Exception as error:  # noqa: BLE001  (raised on every rank below)
            failure = error
        raise_together(failure)
        on_rank0(directory.start)
        logger = None
        try:
            logger = RunLogger(
                run_dir,
                mode=cfg.logging.wandb_mode,
                project=cfg.logging.project,
                name=cfg.run.name,
                tags=list(cfg.logging.tags),
                config=OmegaConf.to_container(cfg, resolve=True),
                rank=dist.get_rank(),
            )
        except Exception as error:  # noqa: BLE001  (raised on every rank below)
            failure = error
        raise_together(failure)
        try:
            results = run_recipe(cfg, mesh, data, run_dir, logger)
        finally:
            logger.close()
        # Which (rows, cols) windows of each variable this rank read from disk: its rows only.
        results["windows_read"] = {
            group: {var: sorted(windows) for var, windows in counts.windows.items()}
            for group, counts in data.train.read_counts().items()
        }
    finally:
        data.close()
    return results
