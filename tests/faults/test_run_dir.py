"""A run directory is a unit of work: one owner at a time, nothing replaced by a failed or
mistaken start, and its metrics consistent after a resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from physics_dp.testing import run_on_ranks
from physics_dp.training.run_dir import RunLock

from ._runs import error_of, logged_steps, overrides, snapshot, train

pytestmark = pytest.mark.timeout(180)  # each case; the waits inside are bounded more tightly


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run on 2 domain ranks (its files are compared, never changed, by the tests)."""
    tmp = tmp_path_factory.mktemp("finished")
    run_on_ranks(2, train, overrides(tmp, "parallel.domain_size=2", "training.max_steps=2"), timeout=300.0)
    return tmp


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["model=lite"], ["RunDirConflictError", "different config", "model.regression.model_channels", "model.size: 'test' -> 'lite'"]),
        (["training.resume=false"], ["RunDirConflictError", "run.overwrite=true"]),
        (["optim.lr=-1"], ["ValueError", "optim.lr=-1.0 is invalid"]),
        (["sampling.num_steps=0"], ["ValueError", "sampling.num_steps must be a positive integer"]),
        (["run.overwrite=true", "data.synthetic.height=2", "data.synthetic.width=8", "data.root=ELSEWHERE"], ["too small"]),
    ],
    ids=["other model", "resume=false", "negative lr", "zero sampling steps", "overwrite but grid too small"],
)
def test_failed_start_leaves_the_finished_run_intact(finished, extra, needles):
    run = finished / "run"
    before = snapshot(run)
    assert {"config.yaml", "regression/model.pt", "regression/checkpoints/latest"} <= before.keys()
    extra = [e.replace("ELSEWHERE", str(finished / "small")) for e in extra]
    for rank, message in enumerate(run_on_ranks(2, error_of, overrides(finished, "parallel.domain_size=2", *extra), timeout=120.0)):
        for needle in needles:
            assert needle in message, f"rank {rank}: {message}"
    assert snapshot(run) == before
    assert not (run / "run.lock").exists()


def test_overwrite_starts_over_and_resume_may_change_layout_and_length(tmp_path):
    run = tmp_path / "run"
    run_on_ranks(2, train, overrides(tmp_path, "parallel.domain_size=2", "training.max_steps=2"), timeout=300.0)
    # Resuming on another layout with more steps is the same run: allowed.
    run_on_ranks(1, train, overrides(tmp_path, "training.max_steps=3"), timeout=300.0)
    assert (run / "regression" / "checkpoints" / "step_000003").is_dir()
    # Another model needs run.overwrite=true, which removes the old run's results first.
    run_on_ranks(1, train, overrides(tmp_path, "training.max_steps=1", "model.regression.model_channels=4", "run.overwrite=true"),
                 timeout=300.0)
    assert sorted(p.name for p in (run / "regression" / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert "model_channels: 4" in (run / "config.yaml").read_text()
    assert logged_steps(run) == [1]


def test_second_job_on_a_run_dir_stops_on_every_rank(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run)  # this test process is the first job, alive and holding the directory
    lock.acquire()
    try:
        for rank, message in enumerate(run_on_ranks(2, error_of, overrides(tmp_path, "training.max_steps=1"), timeout=120.0)):
            assert "RunDirBusyError" in message and f"pid {os.getpid()}" in message and "in use by another job" in message, (rank, message)
        assert sorted(p.name for p in run.iterdir()) == ["run.lock"]  # nothing written, the owner's lock kept
    finally:
        lock.release()
    assert not (run / "run.lock").exists()


def test_stale_lock_of_a_dead_job_does_not_block(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / "run.lock").write_text(f'{{"host": "{os.uname().nodename}", "pid": {dead.pid}, "process_start": null, "started": "then"}}\n')
    result = run_on_ranks(2, train, overrides(tmp_path, "training.max_steps=1"), timeout=300.0)
    assert len(result[0]["losses"]) == 1 and not (run / "run.lock").exists()


def test_rank0_only_failure_is_the_same_error_on_every_rank(tmp_path):
    (tmp_path / "run").write_text("a file where the run directory should be")
    messages = run_on_ranks(2, error_of, overrides(tmp_path, "training.max_steps=1"), timeout=120.0)
    assert messages[0] == messages[1] and messages[0].startswith("NotADirectoryError") and "is not a directory" in messages[0]


def test_metrics_have_no_repeated_steps_after_a_resume(tmp_path):
    run = tmp_path / "run"
    run_on_ranks(2, train, overrides(tmp_path, "parallel.domain_size=2", "training.max_steps=3", "training.checkpoint_interval=2"),
                 timeout=300.0)
    # As if killed after logging step 3 but before its checkpoint: the resume redoes step 3.
    checkpoints = run / "regression" / "checkpoints"
    for path in (checkpoints / "step_000003").iterdir():
        path.unlink()
    (checkpoints / "step_000003").rmdir()
    run_on_ranks(2, train, overrides(tmp_path, "parallel.domain_size=2", "training.max_steps=4", "training.checkpoint_interval=2"),
                 timeout=300.0)
    assert logged_steps(run) == [1, 2, 3, 4]
    assert logged_steps(run, "regression/valid/loss") == [4]  # step 3's belonged to the discarded attempt


def test_lock_of_a_reused_pid_is_stale_and_another_hosts_lock_is_not(tmp_path):
    """A live pid whose process started at another time is not the owner (pids are reused); a lock
    from another host cannot be checked, so it blocks, saying how to clear it."""
    import json

    lock = RunLock(tmp_path)
    held = {**lock.owner, "process_start": lock.owner["process_start"] - 1}  # this pid, an earlier process
    (tmp_path / "run.lock").write_text(json.dumps(held))
    lock.acquire()
    assert json.loads((tmp_path / "run.lock").read_text()) == lock.owner
    lock.release()
    (tmp_path / "run.lock").write_text(json.dumps({**lock.owner, "host": "elsewhere"}))
    with pytest.raises(RuntimeError, match="in use by another job: host elsewhere.*delete the lock file if that job is gone"):
        RunLock(tmp_path).acquire()


def test_a_collective_timeout_in_training_says_what_it_usually_means():
    from physics_dp.training.run import _explain_timeout

    error = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation to complete")
    _explain_timeout(error, 3.0)
    assert "parallel.timeout_s=3 s" in error.__notes__[0] and "not every rank called the same collective" in error.__notes__[0]
    other = ValueError("config key parallel.timeout_s=0.0 is invalid")
    _explain_timeout(other, 3.0)
    assert not getattr(other, "__notes__", None)
