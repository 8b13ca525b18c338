"""collectives.barrier and all_gather_rows, over shared memory (the host channel) or gloo."""

from __future__ import annotations

import os
import time

import pytest

from physics_dp.testing import run_on_ranks


def _arrive_late_then_leave(channel_enabled: bool) -> tuple[float, float, bool]:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    os.environ[host_channel.ENABLE_ENV_VAR] = "1" if channel_enabled else "0"
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        gloo_barrier, calls = dist.barrier, []
        dist.barrier = lambda *args, **kwargs: (calls.append(1), gloo_barrier(*args, **kwargs))[1]
        try:
            collectives.barrier(group)  # opens the channel (if any) before the timed arrival
            time.sleep(0.2 * dist.get_rank())
            arrived = time.time()
            collectives.barrier(group)
            left = time.time()
        finally:
            dist.barrier = gloo_barrier
        return arrived, left, bool(calls)
    finally:
        del os.environ[host_channel.ENABLE_ENV_VAR]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("channel_enabled", [True, False])
def test_barrier_releases_no_rank_before_the_last_arrives(world, channel_enabled):
    results = run_on_ranks(world, _arrive_late_then_leave, channel_enabled)
    last_arrival = max(arrived for arrived, _, _ in results)
    assert all(left >= last_arrival for _, left, _ in results)
    # the shared-memory path never falls back to gloo's barrier; without the channel it must
    assert all(used_gloo is not channel_enabled for _, _, used_gloo in results)


def test_barrier_of_one_rank_returns_at_once():
    assert run_on_ranks(1, _arrive_late_then_leave, True)[0][2] is False


def _gather_rows_three_times(channel_enabled: bool) -> tuple[list, list, list]:
    import torch
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    os.environ[host_channel.ENABLE_ENV_VAR] = "1" if channel_enabled else "0"
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        mine = torch.arange(3, dtype=torch.float64) + 10 * dist.get_rank()
        with collectives.count_communication() as log:
            first = collectives.all_gather_rows(mine, group)
            for scale in (2, 3):  # enough later calls to reuse every buffer the first one went through
                later = collectives.all_gather_rows(mine * scale, group)
        return first.tolist(), later.tolist(), [(r.kind, r.bytes_sent) for r in log.records]
    finally:
        del os.environ[host_channel.ENABLE_ENV_VAR]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("channel_enabled", [True, False])
def test_all_gather_rows_stacks_every_rank_in_order_and_owns_its_result(world, channel_enabled):
    rows = [[10.0 * rank + i for i in range(3)] for rank in range(world)]
    for first, later, records in run_on_ranks(world, _gather_rows_three_times, channel_enabled):
        assert first == rows
        assert later == [[3 * value for value in row] for row in rows]
        assert records == [("all_gather", 3 * 8 * (world - 1))] * 3


def _boolean_and_product_reductions(channel_enabled: bool) -> dict:
    import torch
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    os.environ[host_channel.ENABLE_ENV_VAR] = "1" if channel_enabled else "0"
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        rank = dist.get_rank()
        flags = torch.tensor([True, rank == 0, False])
        return {
            "or": collectives.all_reduce(flags, "sum", group).tolist(),
            "and": collectives.all_reduce(flags, "product", group).tolist(),
            "product": collectives.all_reduce(torch.tensor([2.0, rank + 1.0]), "product", group).tolist(),
        }
    finally:
        del os.environ[host_channel.ENABLE_ENV_VAR]


@pytest.mark.parametrize("channel_enabled", [True, False])
def test_boolean_sums_are_ors_and_products_multiply(channel_enabled):
    """A sum of booleans is a logical or and a product a logical and (NCCL's meaning, which DTensor's
    any / all rules assume); gloo alone adds them as bytes (``any`` over 4 ranks gave 4)."""
    for result in run_on_ranks(3, _boolean_and_product_reductions, channel_enabled):
        assert result == {"or": [True, True, False], "and": [True, False, False], "product": [8.0, 6.0]}
