"""Smoke test of ``benchmarks/model_memory.py``: the memory method counts what it claims, and the
script measures the sharded training step it says it does (never how fast or how small).

Why: a memory figure that silently includes tensors from before the step, or a "sharded" run
whose model fell back to plain tensors, would give confident wrong numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch
from tests.benchmarks._scripts import BENCHMARKS, load_benchmark

MIB = 2**20


def _bench() -> ModuleType:
    return load_benchmark("model_memory")


def test_events_fold_counts_only_blocks_the_window_allocated() -> None:
    bench = _bench()
    a, b, grad, old, reused = 0x10, 0x20, 0x30, 0x40, 0x50
    events = [
        (0, 100, a),
        (1, 50, b),
        (2, -100, a),
        (3, -999, old),  # allocated before the window: ignored
        (4, 70, reused),
        (5, 70, reused),  # same address handed out again: the first block was freed unseen
        (6, 30, grad),
    ]
    memory = bench.step_memory_from_events(events, {grad})
    assert memory.step_peak == 150
    assert memory.activation_peak == 150
    assert memory.end_live == 50 + 70 + 30
    assert memory.gradients_created == 30
    assert memory.allocations == 5


def test_profile_step_memory_sees_the_steps_own_allocations() -> None:
    bench = _bench()
    before = torch.ones(MIB // 4)  # allocated before the step and freed inside: not the step's
    param = torch.nn.Parameter(torch.zeros(MIB // 4))
    kept: list[torch.Tensor] = []

    def step() -> None:
        nonlocal before
        before = None
        param.grad = torch.ones(2 * MIB // 4)[: MIB // 4]  # a 2 MiB storage ends up as a gradient
        kept.append(torch.empty(MIB // 4))  # 1 MiB, alive after the step
        temporary = torch.empty(3 * MIB // 8)  # 1.5 MiB, freed inside
        del temporary

    memory = bench.profile_step_memory(step, lambda: [param.grad], torch.device("cpu"))
    assert memory.step_peak == 2 * MIB + MIB + 3 * MIB // 2
    assert memory.activation_peak == MIB + 3 * MIB // 2
    assert memory.end_live == 3 * MIB
    assert memory.gradients_created == 2 * MIB


def test_script_prints_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    command = [sys.executable, str(BENCHMARKS / "model_memory.py"), "--grid", "16", "24", "--ranks", "1", "2", "--steps", "1", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    configs = [line.split("|")[1].strip() for line in table[2:]]
    assert configs == ["plain x1 thr", "plain x2 thr", "1 rank x1 thr (none)", "2 ranks x1 thr (none)"], done.stdout
    payload = json.loads(out.read_text())
    assert set(payload) >= {"torch", "device", "settings", "rows", "target_slack", "notes"}
    rows = {row["config"]: row for row in payload["rows"]}
    keys = {"step_s", "speedup_vs_plain_1thread", "speedup_vs_plain_same_threads", "params_bytes", "grads_bytes",
            "optimizer_state_bytes", "step_peak_bytes", "activation_peak_bytes", "end_live_bytes", "gradients_created_bytes",
            "activation_ratio_to_1rank", "activation_target_ratio", "bytes_sent", "collectives", "loss"}
    plain = rows["plain x1 thr"]
    for name, row in rows.items():
        assert keys <= set(row), (name, keys - set(row))
        assert row["step_s"] > 0 and row["activation_peak_bytes"] > 0, name
        # Same model and data everywhere: the sharded step computes the single-process loss.
        assert math.isclose(row["loss"], plain["loss"], rel_tol=1e-5), (name, row["loss"], plain["loss"])
        assert row["params_bytes"] == plain["params_bytes"] and row["grads_bytes"] == row["params_bytes"], name
        assert row["gradients_created_bytes"] == row["grads_bytes"], name  # every gradient allocation was seen
        assert row["optimizer_state_bytes"] == 2 * row["params_bytes"], name  # AdamW: exp_avg, exp_avg_sq
    for world in (1, 2):
        row = rows[f"{world} rank{'s' if world > 1 else ''} x1 thr (none)"]
        assert row["output_type"] == "ShardTensor" and row["output_placements"] == "(Shard(dim=2),)"
        assert [r["rank"] for r in row["per_rank"]] == list(range(world))
        assert all(r["local_grid"] == [16 // world, 24] for r in row["per_rank"])
        assert (row["bytes_sent"] > 0) == (world > 1) and row["activation_target_ratio"] == payload["target_slack"] / world
    assert rows["1 rank x1 thr (none)"]["activation_ratio_to_1rank"] == 1.0


def test_sharded_code_runs_a_one_rank_step_through_the_sharded_ops(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    command = [sys.executable, str(BENCHMARKS / "model_memory.py"), "--grid", "16", "24", "--ranks", "1", "--steps", "1",
               "--sharded-code", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {row["config"]: row for row in json.loads(out.read_text())["rows"]}
    sharded = rows["1 rank x1 thr (none, sharded code)"]
    assert sharded["output_type"] == "ShardTensor"
    assert math.isclose(sharded["loss"], rows["plain x1 thr"]["loss"], rel_tol=1e-5)
