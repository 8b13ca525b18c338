"""Tiny training runs for the fault tests: the `model=test` networks on a 16 x 24 synthetic grid."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from physics_dp.config import compose_config


def overrides(tmp: Path | str, *extra: str) -> list[str]:
    """A StormCast regression run in ``tmp/run`` with its synthetic data in ``tmp/data``."""
    return [
        "+experiment=stormcast",
        "training.stage=regression",
        "schedule=constant",
        "data.synthetic.n_times=10",
        "data.synthetic.height=16",
        "data.synthetic.width=24",
        "data.train_times=[0,7]",
        "data.valid_times=[7,10]",
        "training.global_batch_size=2",
        "training.validation_batches=1",
        "training.log_interval=1",
        "logging.wandb_mode=disabled",
        "logging.figures=false",
        f"data.root={tmp}/data",
        f"run.dir={tmp}/run",
        *extra,
    ]


def train(args: list[str]) -> dict:
    """Rank function: train and return this rank's losses and the exported parameters."""
    from physics_dp.training.run import train as run_training

    results = run_training(compose_config(args))
    stage = results["regression"]
    return {"losses": stage.losses, "params": torch.load(stage.exported, weights_only=True)}


def error_of(args: list[str]) -> str:
    """Rank function: the error this rank raises (type and message), or "no error"."""
    try:
        train(args)
    except Exception as error:  # the message each rank would print before exiting non-zero
        return f"{type(error).__name__}: {error}"
    return "no error"


def logged_steps(run: Path, key: str = "regression/loss") -> list[int]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line["step"] for line in lines if key in line]


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run directory (lock excluded) with its bytes, to show a failed start changed nothing."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != "run.lock"}
