"""Sharded, atomic training checkpoints that resume on any parallel layout.

Model and optimizer state go through ``torch.distributed.checkpoint`` (DCP): every rank writes
only what it owns (FSDP2 shards; replicated plain tensors are written once, by one rank), and a
load reshards to whatever layout the current run uses (FSDP over any data width, DDP, none).
FQNs come from ``get_state_dict``, which strips FSDP/DDP wrappers, so a checkpoint written under
one wrapper loads under another.

Atomicity: a checkpoint is written into ``<dir>/step_000123.tmp-<nonce>``; only after every rank
has finished does rank 0 rename it to ``<dir>/step_000123`` and atomically replace ``<dir>/latest``.
A job killed midway leaves a ``.tmp-`` directory that readers ignore and the next save deletes.

All ranks must see the same directory (a shared filesystem), one job writes to a directory at a
time, and every method except ``latest_step`` and ``path_of`` is collective.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from physics_dp.distributed.agreement import on_rank0
from physics_dp.distributed.collectives import all_reduce, broadcast

__all__ = ["CheckpointDamagedError", "Checkpointer", "CheckpointMismatchError", "export_state_dict"]

log = logging.getLogger(__name__)

LATEST_FILE = "latest"
TRAINER_STATE_FILE = "trainer_state.pt"  # step, scheduler state and `extra`, written by rank 0
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_MARKER = ".tmp-"
_DAMAGED_MARKER = ".damaged-"  # set aside by load, kept for inspection, never pruned
_LEFTOVER = re.compile(r"^(step_\d+|latest)\.tmp-")  # unfinished writes of this checkpointer


class CheckpointDamagedError(RuntimeError):
    """A checkpoint's files are missing, truncated or unreadable."""


class CheckpointMismatchError(ValueError):
    """The checkpoint's parameter names or shapes do not match the model being loaded."""


def _step_name(step: int) -> str:
    return f"step_{step:06d}"


def _group() -> dist.ProcessGroup | None:
    """The world group, or None for a plain single process without torch.distributed."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _all_ok(ok: bool) -> bool:
    """Collective: True when every rank reports success (so no rank waits alone in a collective)."""
    group = _group()
    if group is None:
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    return int(all_reduce(flag, "max", group).item()) == 0


def _broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    group = _group()
    if group is None:
        return value
    return int(broadcast(torch.tensor([value], dtype=torch.int64), 0, group).item())


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _flat_tensor_shapes(prefix: str, value: Any) -> Iterator[tuple[str, torch.Size | None]]:
    """DCP's flattened keys of a nested state dict, with global shapes (None for non-tensors)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat_tensor_shapes(f"{prefix}.{key}", item)
    elif isinstance(value, torch.Tensor):
        yield prefix, value.shape  # a DTensor reports its global shape
    else:
        yield prefix, None


class Checkpointer:
    """Save and restore model, optimizer, scheduler and trainer state under ``directory``.

    ``keep`` newest checkpoints are retained (the one just written always is).
    """

    def __init__(self, directory: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least one checkpoint must be kept; pass keep >= 1")
        self.directory = Path(directory)
        self.keep = keep

    # ---- discovery -------------------------------------------------------------------------

    def _complete_steps(self) -> list[int]:
        """Steps with a finished checkpoint directory, ascending (``.tmp-`` ones are unfinished)."""
        if not self.directory.is_dir():
            return []
        steps = []
        for entry in self.directory.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def path_of(self, step: int) -> Path:
        """Directory of the finished checkpoint for ``step``."""
        return self.directory / _step_name(step)

    def latest_step(self) -> int | None:
        """Step named by ``latest`` if that checkpoint exists, else the newest finished one, else None.

        Local (not collective): reads the shared directory.
        """
        latest = self.directory / LATEST_FILE
        if latest.is_file():
            match = _STEP_DIR.match(latest.read_text().strip())
            if match and self.path_of(int(match.group(1))).is_dir():
                return int(match.group(1))
        steps = self._complete_steps()
        return steps[-1] if steps else None

    # ---- save ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: Any = None,
        extra: dict | None = None,
    ) -> Path:
        """Collective: write a checkpoint for ``step`` and return its final directory.

        ``extra`` (picklable: data loader position, RNG states, ...) is taken from rank 0.
        """
        if step < 0:
            raise ValueError(f"step={step}: checkpoint steps must be >= 0")
        nonce = f"{_broadcast_int(secrets.randbits(48)):012x}"
        final = self.path_of(step)
        tmp = self.directory / f"{final.name}{_TMP_MARKER}{nonce}"

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)

        def finish() -> None:
            trainer_state = {
                "step": step,
                "scheduler": None if scheduler is None else scheduler.state_dict(),
                "extra": extra,
            }
            with open(tmp / TRAINER_STATE_FILE, "wb") as handle:
                torch.save(trainer_state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            self._publish(tmp, final, step, nonce)

        # The broadcast inside on_rank0 is the barrier: it also tells every rank when it is done.
        on_rank0(finish)
        return final

    def _publish(self, tmp: Path, final: Path, step: int, nonce: str) -> None:
        """Rank 0: make ``tmp`` the checkpoint ``final``, point ``latest`` at it, prune."""
        if final.exists():  # the same step saved again (e.g. after resuming from an older step)
            final.rename(self.directory / f"{final.name}{_TMP_MARKER}{nonce}-replaced")
        tmp.rename(final)
        _fsync_dir(self.directory)
        latest_tmp = self.directory / f"{LATEST_FILE}{_TMP_MARKER}{nonce}"
        with open(latest_tmp, "w") as handle:
            handle.write(final.name + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(latest_tmp, self.directory / LATEST_FILE)
        _fsync_dir(self.directory)
        self._prune(keep_step=step)

    def _prune(self, keep_step: int) -> None:
        """Rank 0: drop unfinished ``.tmp-`` leftovers and all but the newest ``keep`` checkpoints.

        Leftovers can only come from dead writers because one job owns a checkpoint directory.
        """
        for entry in self.directory.iterdir():
            if _LEFTOVER.match(entry.name):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        others = [s for s in self._complete_steps() if s != keep_step]
        for step in others[: max(0, len(others) - (self.keep - 1))]:
            shutil.rmtree(self.path_of(step), ignore_errors=True)

    # ---- verification ----------------------------------------------------------------------

    def damage(self, step: int) -> str | None:
        """Why the finished checkpoint for ``step`` cannot be loaded (a file missing, truncated or
        unreadable), or None. Local: reads the DCP metadata, file sizes and the trainer state."""
        path = self.path_of(step)
        try:
            metadata = dcp.FileSystemReader(path).read_metadata()
        except Exception as error:  # noqa: BLE001  (any failure to read it means the same)
            return f"its metadata file {path / '.metadata'} cannot be read ({type(error).__name__}: {error})"
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(needed.items()):
            file = path / name
            if not file.is_file():
                return f"its data file {file} is missing"
            if file.stat().st_size < end:
                return f"its data file {file} is truncated ({file.stat().st_size} bytes, {end} expected)"
        try:
            torch.load(path / TRAINER_STATE_FILE, weights_only=False)
        except Exception as error:  # noqa: BLE001
            return f"its trainer state {path / TRAINER_STATE_FILE} cannot be read ({type(error).__name__}: {error})"
        return None

    def _require_intact(self, step: int) -> None:
        problem = self.damage(step)
        if problem is not None:
            raise CheckpointDamagedError(f"checkpoint {self.path_of(step)} cannot be loaded: {problem}")

    def _newest_intact(self) -> int:
        """Rank 0: the newest loadable step (``latest`` first), setting damaged ones aside; -1 if none."""
        latest = self.latest_step()
        steps = sorted(set(self._complete_steps()) | ({latest} if latest is not None else set()), reverse=True)
        if latest is not None:
            steps.remove(latest)
            steps.insert(0, latest)
        for step in steps:
            problem = self.damage(step)
            if problem is None:
                return step
            aside = self.directory / f"{_step_name(step)}{_DAMAGED_MARKER}{secrets.token_hex(4)}"
            self.path_of(step).rename(aside)
            log.warning("checkpoint %s is damaged (%s); set aside as %s, trying an older one", self.path_of(step), problem, aside)
        return -1

    # ---- load ------------------------------------------------------------------------------

    def load(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: Any = None,
        step: int | None = None,
    ) -> dict | None:
        """Collective: restore ``step`` (default: the latest finished one) into the current layout.

        Returns ``{"step": step, "extra": extra}``, or None when there is no checkpoint to load.
        """
        if step is None:  # rank 0 decides (and sets damaged ones aside), so every rank agrees
            agreed = on_rank0(self._newest_intact)
            if agreed < 0:
                return None
            step = agreed
        else:
            path = self.path_of(step)
            if not _all_ok(path.is_dir()):  # agreed, so no rank is left waiting inside dcp.load
                available = self._complete_steps()
                raise FileNotFoundError(
                    f"no finished checkpoint for step {step} at {path}; available steps in "
                    f"{self.directory}: {available or 'none'}"
                )
            on_rank0(lambda: self._require_intact(step))
        path = self.path_of(step)

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        self._check_matches(path, state)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

        # weights_only=False: `extra` may hold any picklable object; the file is one this class wrote.
        trainer_state = torch.load(path / TRAINER_STATE_FILE, weights_only=False)
        if scheduler is not None:
            if trainer_state["scheduler"] is None:
                raise ValueError(
                    f"checkpoint {path} holds no scheduler state; load without a scheduler or "
                    "resume from a checkpoint saved with one"
                )
            scheduler.load_state_dict(trainer_state["scheduler"])
        return {"step": trainer_state["step"], "extra": trainer_state["extra"]}

    @staticmethod
    def _check_matches(path: Path, state: dict) -> None:
        """Raise on every rank, naming the first key whose name or shape differs from the checkpoint.

        Every rank reads the same metadata and compares global shapes, so all raise together.
        """
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        wanted = [(key, "parameter/buffer", shape) for key, shape in _flat_tensor_shapes("model", state["model"])]
        wanted += [
            (key, "optimizer state", shape)
            for key, shape in _flat_tensor_shapes("optim.state", state["optim"]["state"])
            if shape is not None
        ]

        def mismatch(key: str, kind: str, problem: str) -> CheckpointMismatchError:
            name = key.split(".", 1)[1]  # drop DCP's "model."/"optim." prefix: users know these names
            return CheckpointMismatchError(
                f"checkpoint {path} does not match: first mismatching key is {kind} {name!r}: {problem}. "
                "Load it into the model architecture and optimizer type it was saved with."
            )

        for key, kind, shape in wanted:
            if key not in stored:
                raise mismatch(key, kind, "the checkpoint does not have it")
            stored_shape = getattr(stored[key], "size", None)
            if shape is not None and stored_shape is not None and tuple(stored_shape) != tuple(shape):
                raise mismatch(key, kind, f"checkpoint shape {tuple(stored_shape)}, current shape {tuple(shape)}")
        wanted_keys = {key for key, _, _ in wanted}
        for key in stored:
            if key.startswith("model.") and key not in wanted_keys:
                raise mismatch(key, "parameter/buffer", "the checkpoint has it but the model does not")


def export_state_dict(model: nn.Module, path: str | Path) -> None:
    """Collective: write the full, unsharded model state dict as one ``torch.save`` file (rank 0).

    For inference and hand-off: loads on a single process with
    ``model.load_state_dict(torch.load(path))`` whatever the training layout was.
    """
    path = Path(path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}{_TMP_MARKER}{secrets.token_hex(6)}")
        torch.save(full, tmp)
        os.replace(tmp, path)

    on_rank0(write)
