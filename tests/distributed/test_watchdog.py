"""Watchdog: its threads and rank 0's store end with ``stop()``, not later (the silent-rank cases
run whole jobs: tests/faults/test_kills.py)."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from physics_dp.distributed.watchdog import Watchdog
from physics_dp.testing import run_on_ranks


def _start_then_stop(timeout_s: float) -> tuple[int, list[str], bool | None]:
    watchdog = Watchdog(timeout_s)
    watchdog.start()
    port = watchdog._server.port if dist.get_rank() == 0 else None
    threads = list(watchdog._threads)
    dist.barrier()  # every rank has beaten into the store at least once
    watchdog.stop()
    alive = [thread.name for thread in threads if thread.is_alive()]
    refused = None
    if port is not None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            refused = False
        except OSError:
            refused = True
    dist.barrier()
    return len(threads), alive, refused


@pytest.mark.parametrize("world", [2, 3])
def test_stop_joins_the_threads_and_closes_rank_0s_store(world):
    results = run_on_ranks(world, _start_then_stop, 20.0, timeout=60.0)
    assert [started for started, _, _ in results] == [2] * world
    assert [alive for _, alive, _ in results] == [[]] * world
    assert results[0][2] is True  # nothing listens on the store's port any more
    assert all(refused is None for _, _, refused in results[1:])
