"""Run logging for training and inference: wandb plus a plain JSON-lines copy of every scalar, on rank 0 only.

Why rank 0 only: every rank computes the same replicated metrics, so one writer suffices, and a
wandb run per rank would flood the project. Other ranks get the same object whose methods do
nothing, so training code calls it unconditionally.

Why a JSON-lines file too: tests, scripts and users without a wandb account read
``run_dir/metrics.jsonl`` directly (one ``{"step": ..., name: value, ...}`` object per ``log``).

Why wandb gets no ``step=``: a StormCast run trains its stages one after the other, each counting
its steps from 1, and wandb drops every row logged at a step below the run's current one. So the
run's own step only increases (one per ``log``), and each metric family ``PREFIX/...`` (a stage)
is plotted against its own step metric ``PREFIX/step`` (``define_metric``), which every row carries.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch
from tqdm import tqdm

from physics_dp.shard_tensor import Replicate, ShardTensor

MODES = ("online", "offline", "disabled")
_CONSOLE_HANDLER_NAME = "physics_dp.console"


def _scalar_check(key: str, value: Any) -> None:
    """Refuse values rank 0 could only read through a collective (which the other ranks would not join)."""
    if isinstance(value, ShardTensor) and not all(isinstance(p, Replicate) for p in value.placements):
        raise TypeError(
            f"metric {key!r} is a ShardTensor with placements {value.placements}: reduce it to a replicated "
            "value on every rank first (e.g. .full_tensor()), then log"
        )


def _scalar_value(key: str, value: Any) -> float | int:
    if isinstance(value, ShardTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric {key!r} must be an int, float or one-element tensor, got {type(value).__name__}")
    return value


class RunLogger:
    """Scalars and images to wandb and ``run_dir/metrics.jsonl`` from rank 0; a no-op on other ranks.

    ``mode="offline"`` writes the wandb run under ``run_dir/wandb`` without network access (sync
    it later with ``wandb sync``); ``"disabled"`` skips wandb entirely and keeps the JSON lines.
    The JSON-lines file is appended to, so a resumed run continues it.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        mode: str = "offline",
        project: str,
        name: str | None = None,
        tags: Sequence[str] = (),
        config: Mapping[str, Any] | None = None,
        rank: int,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown wandb mode {mode!r}; use one of {MODES}")
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.mode = mode
        self._metrics_file: IO[str] | None = None
        self._run: Any = None
        self._step_metrics: set[str] = set()
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics_file = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8", buffering=1)
        if mode != "disabled":
            import wandb  # deferred: importing wandb costs about a second that other ranks and disabled runs skip

            try:
                self._run = wandb.init(
                    project=project,
                    name=name,
                    tags=list(tags),
                    config=dict(config) if config is not None else None,
                    dir=self.run_dir,
                    mode=mode,
                    reinit="create_new",
                )
            except BaseException:
                self.close()
                raise

    @property
    def active(self) -> bool:
        """Whether this rank writes anything (rank 0 until ``close``)."""
        return self._metrics_file is not None

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record scalar metrics at ``step`` (ints, floats or one-element tensors, replicated if sharded)."""
        for key, value in metrics.items():
            _scalar_check(key, value)
        if not self.active:
            return
        values = {key: _scalar_value(key, value) for key, value in metrics.items()}
        self._metrics_file.write(json.dumps({"step": step, **values}) + "\n")
        self._log_wandb(values, step)

    def _step_metric(self, key: str) -> str:
        """The step metric of ``key``: ``PREFIX/step`` for the family ``PREFIX/...``, else ``step``; defined once."""
        prefix, slash, _ = key.partition("/")
        metric, pattern = (f"{prefix}/step", f"{prefix}/*") if slash else ("step", key)
        if pattern not in self._step_metrics:
            self._step_metrics.add(pattern)
            self._run.define_metric(metric)
            self._run.define_metric(pattern, step_metric=metric)
        return metric

    def _log_wandb(self, values: Mapping[str, Any], step: int) -> None:
        if self._run is not None:
            self._run.log({**values, **{self._step_metric(key): step for key in values}})

    def forget_after(self, prefix: str, step: int) -> int:
        """Drop the ``metrics.jsonl`` lines of metrics named ``prefix...`` logged after ``step``.

        A stage resuming from its checkpoint at ``step`` logs the later steps again; without this the
        file would hold them twice (6, 7, 6, 7, 8, ...). Returns how many lines were dropped.
        """
        if not self.active:
            return 0
        self._metrics_file.close()
        lines = self.metrics_path.read_text(encoding="utf-8").splitlines(keepends=True)

        def later(line: str) -> bool:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a killed job
                return True
            keys = [k for k in record if k != "step"]
            return record.get("step", 0) > step and bool(keys) and all(k.startswith(prefix) for k in keys)

        kept = [line if line.endswith("\n") else line + "\n" for line in lines if not later(line)]
        if len(kept) != len(lines):
            tmp = self.metrics_path.with_name(f".{self.metrics_path.name}.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.metrics_path)
        self._metrics_file = open(self.metrics_path, "a", encoding="utf-8", buffering=1)
        return len(lines) - len(kept)

    def log_image(self, key: str, png_path: str | Path, step: int) -> None:
        """Attach an image file (e.g. from ``plots.plot_prediction``) to the wandb run at ``step``."""
        if not self.active:
            return
        png_path = Path(png_path)
        if not png_path.is_file():
            raise FileNotFoundError(f"cannot log image {key!r}: {png_path} does not exist")
        if self._run is not None:
            import wandb

            self._log_wandb({key: wandb.Image(str(png_path))}, step)

    def progress(self, total_steps: int, initial: int = 0) -> tqdm:
        """A progress bar shown on rank 0 only (disabled elsewhere), refreshed at most once a second."""
        return tqdm(
            total=total_steps,
            initial=initial,
            disable=self.rank != 0,
            mininterval=1.0,
            dynamic_ncols=True,
            unit="step",
        )

    def close(self, exit_code: int = 0) -> None:
        """Finish the wandb run and close the metrics file; safe to call twice."""
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def setup_console_logging(rank: int, stream: IO[str] | None = None) -> logging.Handler:
    """Configure the root logger: rank 0 shows INFO and up, other ranks WARNING and up, lines prefixed with the rank.

    Idempotent: a handler installed by an earlier call is replaced, handlers installed by others
    are left alone. ``stream`` defaults to the current ``sys.stderr``. Returns the handler.
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == _CONSOLE_HANDLER_NAME]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_CONSOLE_HANDLER_NAME)
    handler.setFormatter(
        logging.Formatter(f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    )
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return handler
