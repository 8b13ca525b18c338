"""What one small synchronizing collective costs between ranks on this machine.

Why: a sharded normalization exchanges a few hundred bytes of statistics twice per step (forward
and backward), so its floor is not the slab's kernel time but the kernel plus two collective
latencies.  This prints, for an all-reduce of ``--numel`` float64 values on 2 ranks x 1 thread,
over gloo's sockets and over the shared-memory host channel that physics_dp's small collectives
use (:mod:`physics_dp.distributed.host_channel`): the median and 90th-percentile latency back to
back, and right after each rank did the same pointwise pass over a ``--work`` MiB tensor (as a
normalization's collective follows its moments kernel).  Compare them with an op's slab time to
see what share of it a collective takes.

    python benchmarks/collective_latency.py                 # 2 ranks, 64 values, 32 MiB of work
    python benchmarks/collective_latency.py --calls 100 --work 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from physics_dp.distributed import collectives

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_processes import run_ranks  # noqa: E402

__all__ = ["TRANSPORTS", "measure", "main"]

TRANSPORTS = ("gloo", "host channel")


def _percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(group: Any, numel: int, calls: int, work_mib: float, transport: str = "gloo") -> dict[str, float]:
    """This rank's latencies in microseconds: back to back, and after an equal pointwise pass."""
    payload = torch.zeros(numel, dtype=torch.float64)
    work = torch.randn(max(1, int(work_mib * 2**20 / 4)))
    if transport == "gloo":
        def reduce() -> None:
            dist.all_reduce(payload, group=group)
    elif transport == "host channel":
        def reduce() -> None:
            collectives.all_reduce(payload, "sum", group)
    else:
        raise ValueError(f"unknown transport {transport!r}; expected one of {TRANSPORTS}")
    for _ in range(5):
        reduce()
    idle, after_work = [], []
    for _ in range(calls):
        start = time.perf_counter()
        reduce()
        idle.append(time.perf_counter() - start)
    for _ in range(calls):
        work.mul_(1.0000001).add_(1e-7)
        start = time.perf_counter()
        reduce()
        after_work.append(time.perf_counter() - start)
    return {
        "idle_median_us": statistics.median(idle) * 1e6,
        "idle_p90_us": _percentile(idle, 0.9) * 1e6,
        "after_work_median_us": statistics.median(after_work) * 1e6,
        "after_work_p90_us": _percentile(after_work, 0.9) * 1e6,
    }


def _rank_body(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """This rank's latencies over the whole job, per transport."""
    return {t: measure(dist.group.WORLD, args.numel, args.calls, args.work, t) for t in TRANSPORTS}


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--numel", type=int, default=64, help="float64 values all-reduced (default 64)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--work", type=float, default=32.0, help="MiB each rank passes over before each call")
    args = parser.parse_args(argv)
    rows = run_ranks(args.ranks, _rank_body, args, backend="gloo")
    lines = [f"all_reduce of {args.numel} float64 values, {args.ranks} ranks x 1 thread, {args.calls} calls",
             "", "| transport | rank | back to back: median / p90 us | after a pointwise pass over "
             f"{args.work:g} MiB: median / p90 us |", "| --- | --- | --- | --- |"]
    for transport in TRANSPORTS:
        for rank, by_transport in enumerate(rows):
            row = by_transport[transport]
            lines.append(f"| {transport} | {rank} | {row['idle_median_us']:.0f} / {row['idle_p90_us']:.0f} "
                         f"| {row['after_work_median_us']:.0f} / {row['after_work_p90_us']:.0f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
