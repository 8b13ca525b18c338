"""Smoke test of ``benchmarks/compile_step.py``: it runs eager and compiled steps, plain and sharded,
and reports each (never how fast)."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmarks._scripts import BENCHMARKS


def test_reports_eager_and_compiled_rows_for_plain_and_ranks() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "compile_step.py"), "--grid", "32", "48", "--ranks", "1",
         "--steps", "1", "--warmup", "1", "--backend", "aot_eager"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[1:3] for line in run.stdout.splitlines() if line.startswith("| ") and "step ms" not in line and "---" not in line]
    assert [(c.strip(), b.strip()) for c, b in rows] == [
        ("plain x1 thr", "eager"), ("plain x1 thr", "aot_eager"), ("1 rank x1 thr", "eager"), ("1 rank x1 thr", "aot_eager")
    ], run.stdout
