"""Smoke test of ``benchmarks/norms_gpu.py`` on the CPU: every kind is timed in all three variants,
matches torch, and the row cutting is restored afterwards (never how fast)."""

from __future__ import annotations

import torch

from physics_dp.ops import moments, normalization
from tests.benchmarks._scripts import load_benchmark


def test_every_kind_is_timed_three_ways_and_matches_torch(capsys) -> None:
    script = load_benchmark("norms_gpu")
    cutting = moments.row_parts
    script.main(["--shapes", "2,64,6,5", "--rounds", "3", "--device", "cpu"])
    assert moments.row_parts is cutting and normalization.row_parts is cutting
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows[1:]] == list(script.KINDS)
    for row in rows[1:]:
        assert all(float(cell) > 0 for cell in row[2:5]), row
        assert row[5].strip() == "no" and float(row[6]) < 1e-5, row


def test_statistic_rows_name_what_the_kernel_reads() -> None:
    script = load_benchmark("norms_gpu")
    shape = (2, 64, 8, 4)
    assert script._statistic_rows("layer", shape) == (2, 64 * 32)
    assert script._statistic_rows("group8", shape) == (16, 8 * 32)
    assert script._statistic_rows("batch", shape) == (128, 32)
    assert torch.Size(shape).numel() == 2 * 64 * 32
