"""The minimal tutorials run under torchrun, pass their own single-device checks and say OK once.

Each script asserts its results against one device and exits non-zero otherwise, so a zero
exit status plus the OK line (printed by rank 0 only) is the whole check.  Startup (torchrun
plus one torch import per rank) dominates each run, so all runs start together in a module
fixture and each test waits for its own; this roughly halves the wall time on two cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "minimal"
TIMEOUT_S = 240  # generous: the runs share the machine with each other and with other work

RUNS = [
    ("01_sharded_vector_ops.py", 2),
    ("02_convolution.py", 2),
    ("02_convolution.py", 3),
    ("03_attention.py", 2),
    ("04_custom_op.py", 2),
    ("05_inverse_problem.py", 3),
    ("06_physics_informed.py", 3),
]


@dataclass
class Launched:
    process: subprocess.Popen
    log: Path
    started: float


def _launch(script: str, nproc: int, log: Path) -> Launched:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(EXAMPLES / script),
    ]
    with log.open("w") as out:
        # A new session makes the run (agent and ranks) one process group we can kill on timeout.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Launched(process, log, time.monotonic())


def _finish(run: Launched) -> tuple[int, str]:
    """Exit status and output of a run; kills it (its whole process group) past the deadline."""
    remaining = max(1.0, TIMEOUT_S - (time.monotonic() - run.started))
    try:
        code = run.process.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
        os.killpg(run.process.pid, signal.SIGKILL)
        run.process.wait()
        pytest.fail(f"timed out after {TIMEOUT_S} s:\n{run.log.read_text()[-4000:]}")
    return code, run.log.read_text()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    logs = tmp_path_factory.mktemp("minimal_examples")
    runs = {(script, n): _launch(script, n, logs / f"{Path(script).stem}_n{n}.log") for script, n in RUNS}
    yield runs
    for run in runs.values():
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.process.wait()


@pytest.mark.parametrize("script,nproc", RUNS, ids=[f"{s.split('_')[0]}-n{n}" for s, n in RUNS])
def test_tutorial_runs_and_matches_one_device(launched, script, nproc):
    code, output = _finish(launched[(script, nproc)])
    assert code == 0, f"{script} on {nproc} processes exited with {code}:\n{output[-4000:]}"
    ok_lines = [line for line in output.splitlines() if line.startswith(f"OK {Path(script).stem}")]
    assert len(ok_lines) == 1, f"expected one OK line (rank 0 only), got {ok_lines}:\n{output[-4000:]}"
    assert f"[rank {nproc - 1}/{nproc}]" in output, "every rank should print its per-rank lines"


def test_every_tutorial_is_run():
    scripts = sorted(p.name for p in EXAMPLES.glob("[0-9][0-9]_*.py"))
    assert scripts == sorted({script for script, _ in RUNS})
