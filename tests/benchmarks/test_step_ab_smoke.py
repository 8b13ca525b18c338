"""Smoke test of ``benchmarks/step_ab.py``: the plain and the sharded step alternate and compute the same step.

Checks what was measured, never how fast: rank 0 times one plain and one sharded step per round,
the other rank only sharded steps, every rank one step on its own slab (the floor), both models
start from the same weights and data (equal first losses), and the report pairs each round's
plain time with the slowest rank's sharded and slab times.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from physics_dp.testing import get_mesh, run_on_ranks
from tests.benchmarks._scripts import load_benchmark


def _alternate(memory_format: torch.memory_format = torch.contiguous_format) -> dict:
    return load_benchmark("step_ab").alternate_steps(get_mesh((1, 2), ("data", "domain")), (16, 24), 2, 1, memory_format)


def test_plain_and_sharded_steps_alternate_on_the_same_problem():
    script = load_benchmark("step_ab")
    per_rank = run_on_ranks(2, _alternate)
    assert [len(r["plain"]) for r in per_rank] == [2, 0]
    assert [len(r["sharded"]) for r in per_rank] == [2, 2]
    assert [len(r["slab"]) for r in per_rank] == [2, 2]
    assert per_rank[0]["sharded_loss"] == per_rank[1]["sharded_loss"]
    assert per_rank[0]["plain_loss"] == pytest.approx(per_rank[0]["sharded_loss"], rel=1e-4)
    summary = script.summarize(per_rank)
    assert summary["sharded_s"] == [max(a, b) for a, b in zip(per_rank[0]["sharded"], per_rank[1]["sharded"])]
    assert summary["ratios"] == [p / s for p, s in zip(per_rank[0]["plain"], summary["sharded_s"])]
    slab = [max(a, b) for a, b in zip(per_rank[0]["slab"], per_rank[1]["slab"])]
    assert summary["overheads"] == [s / f for s, f in zip(summary["sharded_s"], slab)]
    assert summary["at_most"] == [p / f for p, f in zip(per_rank[0]["plain"], slab)]
    report = script.format_report(summary, argparse.Namespace(grid=[16, 24], ranks=2, rounds=2, warmup=1, channels_last=False))
    assert report.count("x |") == 4 and "at most" in report and "first-step loss" in report


def test_channels_last_sides_compute_the_same_step():
    """``--channels-last``: every side's batch channels last, and the sharded step's first loss is still the plain one's."""
    per_rank = run_on_ranks(2, _alternate, torch.channels_last)
    assert per_rank[0]["plain_loss"] == pytest.approx(per_rank[0]["sharded_loss"], rel=1e-4)
    assert per_rank[0]["plain_loss"] == pytest.approx(run_on_ranks(2, _alternate)[0]["plain_loss"], rel=1e-4)
