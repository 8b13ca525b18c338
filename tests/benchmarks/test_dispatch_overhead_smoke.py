"""Smoke test of ``benchmarks/dispatch_overhead.py``: it measures every case and compares like with like.

Why: a benchmark that silently times the wrong thing (a fallback that returns a plain tensor, a
regime where no graph is built, different inputs per implementation) gives confident wrong
numbers.  These tests run the measurement with tiny repetition counts and check what was timed,
never how long it took.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tests.benchmarks._scripts import load_benchmark
from physics_dp.testing import get_mesh, run_on_ranks



def _bench() -> ModuleType:
    return load_benchmark("dispatch_overhead")


def _measure_tiny() -> dict[str, Any]:
    """Rank function: the real measurement with tiny counts, plus the single-device reference slabs."""
    bench = _bench()
    mesh = get_mesh((2,))
    report = bench.measure(mesh, warmup=2, calls=6, batch_size=3, return_outputs=True)
    coordinate = mesh.get_coordinate()[0]
    references = {}
    for op, size in itertools.product(bench.OPS, bench.SIZES):
        fn, arity = bench.OPS[op]
        full = fn(*bench.global_inputs(size, mesh.size(0), arity))
        references[f"{op}/{size}"] = full[coordinate * size : (coordinate + 1) * size].clone()
    report["references"] = references
    return report


def test_measure_covers_every_case_and_implementations_agree() -> None:
    bench = _bench()
    reports = run_on_ranks(2, _measure_tiny, timeout=300.0)
    expected_cases = set(itertools.product(bench.OPS, bench.SIZES, bench.REGIMES))
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        rows = report["results"]
        assert {(r["op"], r["size"], r["regime"]) for r in rows} == expected_cases
        assert len(rows) == len(expected_cases)
        for row in rows:
            for impl in bench.IMPLS:
                assert math.isfinite(row[f"{impl}_us"]) and row[f"{impl}_us"] > 0, (rank, row)
        assert set(report["outputs"]) == {f"{op}/{size}/{regime}" for op, size, regime in expected_cases}
        for key, per_impl in report["outputs"].items():
            op, size, regime = key.split("/")
            reference = report["references"][f"{op}/{size}"]
            autograd = regime == "autograd" and op not in bench.FACTORIES
            assert per_impl["plain"]["type"] == "Tensor"
            assert per_impl["dtensor"]["type"] == "DTensor"
            assert per_impl["shardtensor"]["type"] == "ShardTensor", f"{key}: ShardTensor op fell out of the subclass"
            for impl in ("dtensor", "shardtensor"):
                assert per_impl[impl]["placements"] == "(Shard(dim=0),)", (key, impl, per_impl[impl]["placements"])
                assert per_impl[impl]["shape"] == (2 * int(size), *reference.shape[1:]), (key, impl)
            for impl in bench.IMPLS:
                out = per_impl[impl]
                assert out["value"].shape == reference.shape, (key, impl)
                assert out["requires_grad"] is autograd and out["has_grad_fn"] is autograd, (key, impl)
                torch.testing.assert_close(out["value"], reference, rtol=1e-6, atol=1e-6, msg=f"{key} {impl}")
            torch.testing.assert_close(per_impl["shardtensor"]["value"], per_impl["dtensor"]["value"], rtol=0, atol=0)


def test_summary_table_and_verdict_from_rows() -> None:
    bench = _bench()
    rows = [
        {"op": "add", "size": 8, "regime": "no_autograd", "plain_us": 2.0, "dtensor_us": 22.0, "shardtensor_us": 10.0},
        {"op": "gelu", "size": 64, "regime": "autograd", "plain_us": 5.0, "dtensor_us": 25.0, "shardtensor_us": 30.0},
    ]
    summary = bench.summarize(rows)
    assert [r["ratio"] for r in summary] == [0.4, 1.25]
    assert summary[1]["shardtensor_overhead_us"] == 25.0 and summary[1]["dtensor_overhead_us"] == 20.0
    verdict = bench.verdict(summary)
    assert not verdict["overhead_le_dtensor_everywhere"] and not verdict["meets_half_target_everywhere"]
    assert verdict["cases_above_dtensor"] == 1 and verdict["worst"]["op"] == "gelu"
    assert bench.verdict(summary[:1])["meets_half_target_everywhere"]
    table = bench.format_table(summary)
    assert len(table.splitlines()) == 2 + len(rows) and "64x64" in table
    assert bench.format_verdict(verdict).startswith("VERDICT:")


def _report_tiny(json_path: str) -> str | None:
    """Rank function: the script's gather/print/JSON step on the pool (process-group set-up aside)."""
    bench = _bench()
    args = bench.parse_args(
        ["--ops", "add", "--sizes", "8", "--warmup", "1", "--calls", "4", "--batch-size", "2", "--json", json_path]
    )
    return bench.run_and_report(get_mesh((2,)), args)


def test_report_prints_table_and_verdict_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    texts = run_on_ranks(2, _report_tiny, str(out), timeout=120.0)
    assert texts[1] is None  # only rank 0 reports
    assert "VERDICT:" in texts[0] and "add" in texts[0] and "8x8" in texts[0]
    payload = json.loads(out.read_text())
    assert payload["world_size"] == 2 and [r["rank"] for r in payload["ranks"]] == [0, 1]
    for rank in payload["ranks"]:
        cases = {(r["op"], r["size"], r["regime"]) for r in rank["rows"]}
        assert cases == {("add", 8, "no_autograd"), ("add", 8, "autograd")}
    assert set(payload["verdict"]) >= {"overhead_le_dtensor_everywhere", "meets_half_target_everywhere", "worst"}


def test_evicting_batch_streams_the_buffer_before_every_call() -> None:
    """``--evict-mib`` must pass over its buffer once per timed call, or the calls meet warm caches."""
    bench = _bench()
    calls, buffer = [], torch.zeros(1024)

    def op(t: torch.Tensor) -> torch.Tensor:
        calls.append(float(buffer[0]))  # how many passes preceded this call
        return t

    per_call = bench._time_batch(op, [torch.ones(1)], 5, evict=buffer)
    assert calls == [1.0, 2.0, 3.0, 4.0, 5.0] and per_call > 0
    assert bench.parse_args([]).evict_mib == 0 and bench.parse_args(["--evict-mib", "64"]).evict_mib == 64
