"""collectives.barrier: every rank leaves after the last one arrives, over shared memory or gloo."""

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
