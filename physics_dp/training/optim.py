"""Optimizer and learning-rate schedule from the ``optim`` and ``schedule`` config groups."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..config import OptimConfig, ScheduleConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(cfg: OptimConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW, Adam or SGD over ``params`` (FSDP's DTensor parameters included).

    ``cfg.fused``: torch's fused kernel updates every parameter in one call. Its default loop runs
    about ten small ops per parameter tensor: on one CPU thread an AdamW step of the StormCast test
    model (110 tensors) took 1.9 ms against 0.33 fused, of the lite model (214) 6.8 against 1.7.
    """
    params = [p for p in params if p.requires_grad]
    fused = cfg.fused or None  # None: torch's own choice
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused)
    raise ValueError(f"unknown optimizer {cfg.name!r}; choose adamw, adam or sgd")


def lr_factor(cfg: ScheduleConfig, step: int, max_steps: int) -> float:
    """Multiplier of the base learning rate at ``step``: linear warmup, then constant, cosine or
    linear decay to ``min_lr_ratio`` at ``max_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    span = max(max_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.name == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, max_steps: int) -> LambdaLR:
    if cfg.name not in ("constant", "cosine", "linear"):
        raise ValueError(f"unknown schedule {cfg.name!r}; choose constant, cosine or linear")
    return LambdaLR(optimizer, lambda step: lr_factor(cfg, step, max_steps))
