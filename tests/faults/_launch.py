"""Real jobs under torchrun for the fault tests: start, find a rank's process, wait with a bound."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def torchrun(args: list[str], tmp: Path, nproc: int = 2, module: str | None = "physics_dp.train", name: str = "job") -> subprocess.Popen:
    """Start ``torchrun --standalone`` with stdout/stderr in ``tmp/<name>.out`` / ``.err``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", module] if module else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PHYSICS_DP_CACHE": str(tmp / "cache")}
    return subprocess.Popen(
        command + args, cwd=tmp, env=env, stdout=open(tmp / f"{name}.out", "w"), stderr=open(tmp / f"{name}.err", "w")
    )


def stderr_of(tmp: Path, name: str = "job") -> str:
    return (tmp / f"{name}.err").read_text()


def wait_for(condition: Callable[[], bool], timeout: float, what: str, job: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if job is not None and job.poll() is not None:
            pytest.fail(f"the job ended (rc {job.returncode}) before {what}")
        if time.monotonic() > deadline:
            if job is not None:
                job.kill()
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def finish(job: subprocess.Popen, timeout: float) -> int:
    """The job's exit code; fails the test (after killing it) if it runs past ``timeout`` seconds."""
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        pytest.fail(f"the job did not end within {timeout} s")


def rank_pid(job: subprocess.Popen, rank: int) -> int:
    """Process id of global rank ``rank``, a child of the torchrun agent."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0") if ppid == job.pid else []
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise LookupError(f"no rank {rank} among the children of torchrun (pid {job.pid})")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
