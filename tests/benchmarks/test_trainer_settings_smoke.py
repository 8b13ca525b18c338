"""Smoke test of ``benchmarks/trainer_settings.py``: each setting trains through the real trainer, in turn.

Checks what was measured, never how fast: every setting's run logs one ``step_s`` per step, the
settings that train the same model the same way (FSDP, DDP or no wrapper on one data replica) end
on the same loss, and the summary's ratios are to the first setting, round by round.
"""

from __future__ import annotations

import argparse

import pytest

from physics_dp.testing import run_on_ranks
from tests.benchmarks._scripts import load_benchmark

SETTINGS = ["", "parallel.data_parallel=ddp", "parallel.data_parallel=none"]
COMMON = ["model=test", "parallel.domain_size=2", "training.max_steps=3", "training.global_batch_size=1", "data.synthetic.height=32",
          "data.synthetic.width=48", "data.synthetic.n_times=16", "data.train_times=[0,12]", "data.valid_times=[12,16]"]


def _train(root: str) -> dict:
    return load_benchmark("trainer_settings").train_settings(root, COMMON, SETTINGS, 2)


def test_settings_take_turns_through_the_trainer(tmp_path):
    script = load_benchmark("trainer_settings")
    runs = run_on_ranks(2, _train, str(tmp_path), timeout=300.0)[0]
    assert list(runs) == SETTINGS
    for setting, done in runs.items():
        assert len(done) == 2 and all(len(run["step_s"]) == 3 for run in done), setting
    losses = {run["loss"] for done in runs.values() for run in done}
    assert max(losses) == pytest.approx(min(losses), rel=1e-5)  # one replica: every wrapper trains alike
    summary = script.summarize(runs, warmup=1)
    assert summary[""]["ratio"] == 1.0
    for setting, result in summary.items():
        assert result["min_s"] <= result["median_s"] <= result["max_s"]
    args = argparse.Namespace(model="test", grid=[32, 48], ranks=2, domain=2, steps=3, warmup=1, rounds=2)
    report = script.format_report(summary, args)
    assert report.count("\n| ") == len(SETTINGS) + 2 and "(defaults)" in report  # the header, its rule, a row each
