"""Smoke test of ``benchmarks/op_counts.py``: it counts what each side issues, and only kernels."""

from __future__ import annotations

import torch

from physics_dp.testing import get_mesh, run_on_ranks
from tests.benchmarks._scripts import load_benchmark


def _measure() -> list[dict]:
    return load_benchmark("op_counts").measure(get_mesh((2,)))


def test_every_op_is_counted_on_both_sides() -> None:
    rows = {row["name"]: row for row in run_on_ranks(2, _measure)[0]}
    assert set(rows) == set(load_benchmark("op_counts").cases())
    # torch's group norm is one fused kernel each way (the backward also accumulates three .grads)
    assert (rows["group_norm, 8 groups"]["plain_forward"], rows["group_norm, 8 groups"]["plain_backward"]) == (1, 4)
    # a pointwise op on ShardTensors runs torch's op on the slab: the same kernels as plain torch
    silu = rows["silu"]
    assert (silu["sharded_forward"], silu["sharded_backward"]) == (silu["plain_forward"], silu["plain_backward"])
    for name in ("conv2d 3x3, padding 1", "group_norm, 8 groups", "batch_norm, training", "layer_norm over (C, H, W)"):
        row = rows[name]  # halos and statistics add kernels: the sharded side must have been counted
        assert row["sharded_forward"] > row["plain_forward"] and row["sharded_calls"] > row["plain_calls"], (name, row)


def test_views_and_allocations_are_not_kernels() -> None:
    counter = load_benchmark("op_counts")._OpCounter()
    x = torch.ones(4, 4)
    with counter:
        y = x.view(16).unsqueeze(0)  # two views
        torch.empty(3)  # allocations
        x.new_empty(2)
        torch.empty_like(x)
        y * 2.0  # one kernel
    assert (counter.kernels, counter.calls) == (1, 6)
