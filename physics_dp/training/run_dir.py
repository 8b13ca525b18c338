"""A run directory as a unit of work with one owner.

- A lock file (``run.lock``: host, pid, process start, time) is taken by rank 0 for the whole job, so
  a second job on the same ``run.dir`` stops at once with the owner named, instead of deleting the
  first job's checkpoints and interleaving its metrics. A lock whose process is gone (same host,
  pid dead or reused) is stale and taken over with a warning.
- An existing run (it has a ``config.yaml``) is compared with the new config before anything is
  written: keys that change what is trained must match to resume; starting over needs
  ``run.overwrite=true`` (or a new ``run.dir``), never a silent replacement.
- ``config.yaml`` is written only by :meth:`RunDirectory.start`, once every check has passed, so a
  failed start leaves an existing run (config, checkpoints, ``model.pt``, ``latest``) untouched.

Everything here runs on rank 0 (the directory is shared); :func:`physics_dp.distributed.agreement.on_rank0`
turns a failure into the same error on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["RESUMABLE_KEYS", "RunDirBusyError", "RunDirConflictError", "RunDirectory", "RunLock", "config_differences"]

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.yaml"
# What a run directory holds besides the lock: removed by run.overwrite=true.
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "regression", "diffusion")
# Keys that may change when a run resumes (layout, length, logging, intervals); any other
# difference means another experiment and would make the checkpoints and model.pt misleading.
RESUMABLE_KEYS = (
    "run",
    "parallel",
    "logging",
    "sampling",
    "data.prefetch",
    "data.root",
    "training.max_steps",
    "training.resume",
    "training.stage",
    "training.checkpoint_interval",
    "training.validation_interval",
    "training.validation_batches",
    "training.log_interval",
    "training.keep_checkpoints",
)


class RunDirBusyError(RuntimeError):
    """Another live job owns the run directory."""


class RunDirConflictError(ValueError):
    """The run directory holds a run this config may not resume or silently replace."""


def _process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid from its first owner."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, started: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    now = _process_start(pid)
    return started is None or now is None or now == started


class RunLock:
    """An exclusive lock on a directory held by this process (created atomically with a hard link)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self.owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        self.held = False

    def _holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            raise RunDirBusyError(
                f"the run directory lock {self.path} cannot be read ({error}); if no job uses {self.path.parent}, delete it"
            ) from error

    def _stale(self, holder: dict[str, Any]) -> bool:
        return holder.get("host") == self.owner["host"] and not _alive(int(holder["pid"]), holder.get("process_start"))

    def acquire(self) -> None:
        """Take the lock, taking over a stale one; raise RunDirBusyError naming a live owner."""
        tmp = self.path.with_name(f".{LOCK_FILE}.{secrets.token_hex(6)}")
        tmp.write_text(json.dumps(self.owner) + "\n")
        try:
            for _ in range(3):  # a stale lock removed concurrently by another job: try again
                try:
                    os.link(tmp, self.path)
                    self.held = True
                    return
                except FileExistsError:
                    holder = self._holder()
                    if holder is None:
                        continue
                    if not self._stale(holder):
                        raise RunDirBusyError(
                            f"run.dir {self.path.parent} is in use by another job: host {holder.get('host')}, "
                            f"pid {holder.get('pid')}, started {holder.get('started')} (lock file {self.path}). "
                            "Wait for that job to end, choose another run.dir, or delete the lock file if that job is gone."
                        )
                    log.warning(
                        "taking over the stale lock %s of a job that is gone (host %s, pid %s, started %s)",
                        self.path, holder.get("host"), holder.get("pid"), holder.get("started"),
                    )
                    stale = self.path.with_name(f".{LOCK_FILE}.stale-{secrets.token_hex(6)}")
                    try:
                        os.rename(self.path, stale)  # only one taker wins the rename
                        stale.unlink()
                    except FileNotFoundError:
                        pass
            raise RunDirBusyError(f"could not take the lock {self.path}: other jobs keep taking it; use another run.dir")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        if self.held:
            self.held = False
            try:
                if json.loads(self.path.read_text()).get("pid") == self.owner["pid"]:
                    self.path.unlink()
            except (OSError, ValueError):
                pass


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def config_differences(stored: dict, current: dict) -> list[str]:
    """``key: stored -> current`` for every key outside RESUMABLE_KEYS whose value differs."""
    old, new = _flatten(stored), _flatten(current)

    def resumable(key: str) -> bool:
        return any(key == r or key.startswith(r + ".") for r in RESUMABLE_KEYS)

    keys = sorted(k for k in old.keys() | new.keys() if not resumable(k) and old.get(k, "<absent>") != new.get(k, "<absent>"))
    return [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in keys]


class RunDirectory:
    """Rank 0's handle on ``run.dir`` for one job: checks and lock first, writes only in ``start``."""

    def __init__(self, path: Path, cfg: DictConfig):
        self.path = Path(path)
        self.cfg = cfg
        self.lock = RunLock(self.path)
        self.existing = False

    def claim(self) -> None:
        """Create the directory, take the lock, and decide whether the config may run here."""
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"run.dir {self.path} exists and is not a directory; choose a directory path")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OSError(f"cannot create run.dir {self.path} ({error}); choose a writable location") from error
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise PermissionError(f"run.dir {self.path} is not writable by this user; choose a writable location")
        self.lock.acquire()
        try:
            self._check_existing()
        except BaseException:
            self.lock.release()
            raise

    def _check_existing(self) -> None:
        config = self.path / CONFIG_FILE
        self.existing = config.is_file()
        if not self.existing or self.cfg.run.overwrite:
            return
        if not self.cfg.training.resume:
            raise RunDirConflictError(
                f"run.dir {self.path} already holds a run and training.resume=false would start it over, replacing its "
                "checkpoints and model.pt: pass run.overwrite=true to replace it, or choose a new run.dir"
            )
        stored = OmegaConf.to_container(OmegaConf.load(config), resolve=True)
        current = OmegaConf.to_container(self.cfg, resolve=True)
        differences = config_differences(stored, current)
        if differences:
            raise RunDirConflictError(
                f"run.dir {self.path} holds a run with a different config, so it cannot resume it: "
                + "; ".join(differences)
                + ". Resume with the run's values, choose a new run.dir, or pass run.overwrite=true to start over "
                "(deletes its checkpoints and model.pt)"
            )

    def start(self) -> None:
        """The run is known to start: clear an overwritten run, then write ``config.yaml`` atomically."""
        if self.existing and self.cfg.run.overwrite:
            log.warning("run.overwrite=true: deleting the previous run's outputs in %s", self.path)
            for name in RUN_OUTPUTS:
                target = self.path / name
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
        tmp = self.path / f".{CONFIG_FILE}.{secrets.token_hex(6)}"
        tmp.write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
        os.replace(tmp, self.path / CONFIG_FILE)

    def release(self) -> None:
        self.lock.release()
