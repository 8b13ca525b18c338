"""Smoke test of ``benchmarks/step_families.py``: each module family is timed inside the real step, on both sides.

Checks what was measured, never how fast: every family's modules are counted once per forward
on the sharded and the slab model alike, their forward and backward clocks are read (a module
fed the data keeps its backward unmarked), the families never exceed the step that holds them,
and the summary's floor counts attention N times.
"""

from __future__ import annotations

import argparse

from physics_dp.testing import get_mesh, run_on_ranks
from tests.benchmarks._scripts import load_benchmark


def _time() -> dict:
    return load_benchmark("step_families").time_families(get_mesh((1, 2), ("data", "domain")), (32, 48), 2, 1)


def test_each_family_is_timed_inside_both_steps():
    script = load_benchmark("step_families")
    per_rank = run_on_ranks(2, _time)
    for result in per_rank:
        assert result["ranks"] == 2 and len(result["sharded"]) == len(result["slab"]) == 2
        for side in ("sharded", "slab"):
            for round_ in result[side]:
                assert round_["calls"] == per_rank[0]["sharded"][0]["calls"]  # the same modules, once each
                assert set(round_["calls"]) == set(script.FAMILIES)
                seconds = round_["seconds"]
                for family in script.FAMILIES:
                    assert seconds[f"{family}/forward"] > 0 and seconds[f"{family}/backward"] > 0
                assert sum(v for k, v in seconds.items() if not k.endswith("/waited")) < round_["step"]
        assert all(r["waited"] == 0.0 for r in result["slab"])  # the floor never meets another rank

    summaries = script.summarize(per_rank)
    for summary in summaries:
        rows = {row["family"]: row for row in summary["rows"]}
        assert rows["attention"]["floor_ms"] == 2 * rows["attention"]["slab_ms"]
        assert rows["step"]["floor_ms"] == rows["step"]["slab_ms"] + rows["attention"]["slab_ms"]
        families = sum(rows[f]["sharded_ms"] for f in script.FAMILIES)
        assert abs(families + rows["everything else"]["sharded_ms"] - rows["step"]["sharded_ms"]) < 1e-6
    report = script.format_report(summaries, argparse.Namespace(grid=[32, 48], ranks=2, rounds=2, warmup=1, channels_last=False))
    assert report.count("\n| ") == 2 + len(script.FAMILIES) + 2 and "step / floor" in report
    first = summaries[0]["rows"][0]  # a family's row reports its extra per call
    assert f"| {first['extra_ms'] / first['calls']:.2f} |" in report.splitlines()[4]
