"""Checkpoints under faults: a writer killed mid-write leaves the previous checkpoint in charge, and
a damaged latest checkpoint makes a resumed run fall back to the newest intact one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from physics_dp.testing import run_on_ranks
from physics_dp.training.checkpoint import Checkpointer

from ..training.test_checkpoint import _assert_bitwise_equal, _build, _full_state, _save_steps
from ._runs import logged_steps, overrides, train

pytestmark = pytest.mark.timeout(240)


def test_truncated_latest_checkpoint_falls_back_and_the_run_still_ends_bitwise(tmp_path):
    """4 steps (checkpoints at 2 and 4), a shard of step 4 cut in half, resumed to 6: the run warns,
    resumes from step 2 and ends with the parameters of 6 uninterrupted steps."""
    args = ["parallel.domain_size=2", "training.checkpoint_interval=2"]
    run_on_ranks(2, train, overrides(tmp_path, *args, "training.max_steps=4"), timeout=300.0)
    checkpoints = tmp_path / "run" / "regression" / "checkpoints"
    shard = sorted((checkpoints / "step_000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = run_on_ranks(2, train, overrides(tmp_path, *args, "training.max_steps=6"), timeout=300.0)
    assert len(resumed[0]["losses"]) == 4  # steps 3 to 6: resumed from step 2
    assert [p.name for p in checkpoints.iterdir() if ".damaged-" in p.name]
    straight = run_on_ranks(2, train, overrides(tmp_path / "straight", *args, "training.max_steps=6"), timeout=300.0)
    for name, value in resumed[0]["params"].items():
        assert torch.equal(value, straight[0]["params"][name]), name
    assert logged_steps(tmp_path / "run") == [1, 2, 3, 4, 5, 6]


_CHILD = r"""
import sys, time
from pathlib import Path
import torch, torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs
sys.path.insert(0, sys.argv[3])
from test_checkpoint import _build, _train, _full_state
from physics_dp.training.checkpoint import Checkpointer

directory, flag = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo", store=dist.FileStore(str(flag) + ".store", 1), rank=0, world_size=1)
model, optimizer, scheduler = _build((1, 1, "none"), seed=0)
_train(model, optimizer, scheduler, 1)
checkpointer = Checkpointer(directory)
checkpointer.save(1, model, optimizer, scheduler, extra={"note": "first"})
torch.save(_full_state(model, optimizer), str(flag) + ".expected")
_train(model, optimizer, scheduler, 1)

original, written = dcp_fs._write_item, []
def write_then_stall(transforms, stream, *args, **kwargs):
    result = original(transforms, stream, *args, **kwargs)
    written.append(result)
    if len(written) == 3:  # part of the step-2 data is on disk: wait to be killed
        stream.flush()
        flag.write_text("writing")
        time.sleep(600)
    return result
dcp_fs._write_item = write_then_stall
checkpointer.save(2, model, optimizer, scheduler)
"""


def _resume_state(directory: str) -> tuple[dict, dict]:
    model, optimizer, scheduler = _build((1, 2, "none"), seed=3)
    resumed = Checkpointer(directory).load(model, optimizer, scheduler)
    return resumed, _full_state(model, optimizer)


def test_writer_killed_midway_leaves_previous_checkpoint(tmp_path):
    directory, flag = tmp_path / "ckpt", tmp_path / "flag"
    (tmp_path / "child.py").write_text(_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.Popen(
        [sys.executable, str(tmp_path / "child.py"), str(directory), str(flag), str(Path(__file__).parent.parent / "training")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not flag.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            out, err = child.communicate()
            pytest.fail(f"child never reached the write of step 2:\n{err.decode()[-3000:]}")
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()

    partial = [p for p in directory.iterdir() if p.name.startswith("step_000002.tmp-")]
    assert len(partial) == 1 and any(f.suffix == ".distcp" for f in partial[0].iterdir())
    assert not (directory / "step_000002").exists()
    assert (directory / "latest").read_text().strip() == "step_000001"
    assert Checkpointer(directory).latest_step() == 1

    resumed, state = run_on_ranks(2, _resume_state, str(directory))[0]
    assert resumed == {"step": 1, "extra": {"note": "first"}}
    _assert_bitwise_equal(state, torch.load(str(flag) + ".expected"))
    # The next save cleans the leftover up.
    run_on_ranks(2, _save_steps, str(directory), [2], 3)
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step_000001", "step_000002"]
