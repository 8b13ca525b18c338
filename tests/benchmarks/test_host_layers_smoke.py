"""Smoke test of ``benchmarks/host_layers.py``: each layer is timed on what it names, warm and cold."""

from __future__ import annotations

import torch

from physics_dp.testing import get_mesh, run_on_ranks
from tests.benchmarks._scripts import load_benchmark


def _measure_tiny() -> list[dict]:
    return load_benchmark("host_layers").measure(get_mesh((2,)), calls=3, evict_mib=1)


def test_every_layer_is_timed_on_the_tensors_it_names() -> None:
    rows = run_on_ranks(2, _measure_tiny)[0]
    returns = {row["name"]: row["returns"] for row in rows}
    assert len(rows) == len(returns) == 9
    for name in ("ShardTensor mul, no autograd", "one ShardTensor wrapper", "slab out and back, autograd", "sharded 1x1 conv"):
        assert returns[name] == "ShardTensor", (name, returns[name])
    for name in ("plain mul", "plain 1x1 conv", "all-reduce of 17 float64"):
        assert returns[name] == "Tensor", (name, returns[name])
    assert all(row["warm_us"] > 0 and row["cold_us"] > 0 for row in rows)


def test_each_cold_call_follows_one_pass_over_the_buffer() -> None:
    bench = load_benchmark("host_layers")
    buffer = torch.zeros(1024)
    calls = []
    bench._timed_calls(lambda: calls.append(buffer[0].item()), 4, False, buffer)
    # five untimed warm-up calls see an untouched buffer, then each timed call one more pass
    assert calls == [0.0] * 5 + [1.0, 2.0, 3.0, 4.0]
