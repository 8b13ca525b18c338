"""Printing helpers shared by the tutorials: per-rank lines in rank order, summaries once."""

from __future__ import annotations

import torch.distributed as dist

from physics_dp import DistributedManager


def print_in_rank_order(message: str) -> None:
    """Every rank prints its line, rank 0 first, so the output reads like a table.

    Collective (every rank must call it): each rank waits at a barrier for its turn.
    """
    manager = DistributedManager()
    for turn in range(manager.world_size):
        if turn == manager.rank:
            print(f"[rank {manager.rank}/{manager.world_size}] {message}", flush=True)
        dist.barrier()


def print0(message: str) -> None:
    """Print once, on rank 0 (results every rank agrees on)."""
    if DistributedManager().rank == 0:
        print(message, flush=True)
