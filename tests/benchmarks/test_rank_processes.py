"""``benchmarks/rank_processes.py``: fresh rank processes return every rank's result, and a rank
that fails ends the run (never a hang) unless it died tearing down after every result was in."""

from __future__ import annotations

import atexit
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.benchmarks._scripts import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
from rank_processes import run_ranks  # noqa: E402


def _who(tag: str) -> tuple[str, int, int, int]:
    return tag, dist.get_rank(), dist.get_world_size(), torch.get_num_threads()


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 would wait here for good without the spawn's watch


def _rank_one_aborts_now() -> None:
    if dist.get_rank() == 1:
        os.abort()
    dist.barrier()


def _rank_one_aborts_at_exit() -> int:
    if dist.get_rank() == 1:
        atexit.register(os.abort)  # runs after the result is gathered and the job torn down
    return dist.get_rank()


def test_every_rank_returns_its_result_in_rank_order_on_one_thread() -> None:
    assert run_ranks(2, _who, "x") == [("x", 0, 2, 1), ("x", 1, 2, 1)]


def test_a_rank_that_raises_ends_the_run_with_its_error() -> None:
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 refuses"):
        run_ranks(2, _rank_one_raises)


def test_a_rank_that_dies_before_the_results_are_in_fails_the_run() -> None:
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        run_ranks(2, _rank_one_aborts_now)


def test_a_rank_killed_while_tearing_down_keeps_the_results_and_says_so(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_ranks(2, _rank_one_aborts_at_exit) == [0, 1]
    assert "rank 1 was killed by SIGABRT while tearing down" in capfd.readouterr().err
