"""Processes killed or stopped for real under torchrun: every rank ends with a message within a
bounded time, and a killed run resumes bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from physics_dp.testing import run_on_ranks

from ._launch import alive, finish, rank_pid, stderr_of, torchrun, wait_for
from ._runs import logged_steps, overrides, train

STEPS = 16

pytestmark = pytest.mark.timeout(240)  # each case; the waits inside are bounded more tightly


def _params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_sigkill_of_one_rank_mid_run_then_resume_is_bitwise(tmp_path):
    args = overrides(tmp_path, "parallel.domain_size=2", f"training.max_steps={STEPS}", "training.checkpoint_interval=4")
    run = tmp_path / "run"
    job = torchrun(args, tmp_path)
    wait_for(lambda: (run / "metrics.jsonl").is_file() and len(logged_steps(run)) >= 6, 120, "step 6", job)
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    assert finish(job, 60) != 0
    reached = logged_steps(run)[-1]
    assert reached < STEPS, "the job finished before the kill: make the run longer"
    resumed = torchrun(args, tmp_path, name="resume")
    assert finish(resumed, 180) == 0, stderr_of(tmp_path, "resume")[-3000:]
    assert "resumed from step" in stderr_of(tmp_path, "resume")
    assert logged_steps(run) == list(range(1, STEPS + 1))  # the redone steps are not repeated
    reference = run_on_ranks(2, train, overrides(tmp_path / "straight", "parallel.domain_size=2", f"training.max_steps={STEPS}"),
                             timeout=300.0)[0]["params"]
    for name, value in _params(run / "regression" / "model.pt").items():
        assert torch.equal(value, reference[name]), name


@pytest.mark.parametrize("victim", [1, 0], ids=["rank 1", "rank 0 (hosts the heartbeat store)"])
def test_sigstop_of_one_rank_ends_every_rank_naming_it(tmp_path, victim):
    args = overrides(tmp_path, "parallel.domain_size=2", "training.max_steps=100000", "parallel.timeout_s=4")
    run = tmp_path / "run"
    job = torchrun(args, tmp_path)
    wait_for(lambda: (run / "metrics.jsonl").is_file() and len(logged_steps(run)) >= 2, 120, "step 2", job)
    stopped = rank_pid(job, victim)
    os.kill(stopped, signal.SIGSTOP)
    try:
        assert finish(job, 60) != 0
    finally:
        if alive(stopped):  # never leave a stopped process behind, even when the test fails
            os.kill(stopped, signal.SIGKILL)
    err = stderr_of(tmp_path)
    other = 1 - victim
    assert f"rank {other}: rank {victim} (host" in err and f"pid {stopped}) has shown no sign of life" in err, err[-3000:]
    assert "parallel.timeout_s=4" in err
    assert not alive(stopped)


ONE_RANK_COLLECTIVE = """
import torch
from physics_dp import DistributedManager, Shard, ShardTensor

DistributedManager.initialize(timeout=3)
manager = DistributedManager()
mesh = manager.initialize_mesh((2,), ("domain",))
x = ShardTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], sharding_shapes="chunk", global_shape=(4, 3))
if manager.rank == 0:
    x.full_tensor()  # a collective on one rank only: rank 1 never joins
else:
    import time
    time.sleep(600)
"""


def test_collective_on_one_rank_only_ends_with_a_message(tmp_path):
    (tmp_path / "script.py").write_text(ONE_RANK_COLLECTIVE)
    job = torchrun([str(tmp_path / "script.py")], tmp_path, module=None)
    assert finish(job, 90) != 0
    err = stderr_of(tmp_path)
    assert "Timed out waiting 3000ms" in err and "full_tensor" in err, err[-3000:]
