"""Where a sharded training step's time goes: torch.profiler over the StormCast regression U-Net step.

Spawns N gloo ranks x 1 thread; each runs forward, ``((out - target)**2).mean()``, backward on a
global (1, 3 + 5, H, W) field sharded over H, and rank 0 (or ``--rank``) prints the ops with the most self CPU
time over the profiled steps, as a markdown table with each op's share of the total, plus the
collectives the step issued.  Every rank keeps freed host memory, as the trainer does by default.
Run it on two commits to compare before and after a change.

    python benchmarks/step_profile.py [--ranks 2] [--grid 128 192] [--steps 2] [--rows 15] [--rank 0] [--slab]

``--slab`` profiles the step's floor under the same conditions: every rank at once runs the plain
model on its own slab (the rows it holds when sharded) as a plain tensor, so each rank's time
includes what the other ranks running beside it cost it (shared caches and memory bandwidth),
and the difference from the sharded profile is the framework's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_memory import build_model  # noqa: E402
from rank_processes import run_ranks  # noqa: E402


def _rank_body(args: argparse.Namespace) -> None:
    """Profile this rank's steps; the chosen rank prints the table."""
    from physics_dp.distributed import DistributedManager
    from physics_dp.distributed.collectives import count_communication
    from physics_dp.distributed.host_memory import keep_freed_memory
    from physics_dp.shard_tensor import Shard, distribute_tensor

    keep_freed_memory()  # as the trainer does by default
    manager = DistributedManager()
    rank, world = manager.rank, manager.world_size
    mesh = manager.initialize_mesh((world,), ("domain",))
    height, width = args.grid
    model = build_model((height, width), 3, 5)
    gen = torch.Generator().manual_seed(0)
    state, condition, target = (torch.randn(1, c, height, width, generator=gen) for c in (3, 5, 3))
    state, condition, target = (distribute_tensor(t, mesh, [Shard(2)]) for t in (state, condition, target))
    if args.slab:  # the floor: the same model on this rank's slab as a plain tensor, beside the other ranks
        state, condition, target = (t.to_local().detach().clone() for t in (state, condition, target))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        ((model(state, condition) - target) ** 2).mean().backward()

    for _ in range(2):
        step()
    with count_communication() as log:
        step()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    if rank == args.rank:
        averages = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in averages)
        what = "each on its own slab, plain" if args.slab else "sharded"
        print(f"{world} ranks ({what}), grid {height}x{width}, {args.steps} steps: {total / 1e3 / args.steps:.0f} ms self CPU "
              f"per step on rank {rank}; {log.calls} collectives per step\n")
        print("| op | self CPU ms / step | share | calls / step |\n| --- | --- | --- | --- |")
        for event in averages[: args.rows]:
            print(f"| {event.key} | {event.self_cpu_time_total / 1e3 / args.steps:.1f} | "
                  f"{100 * event.self_cpu_time_total / total:.1f} % | {event.count // args.steps} |")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--grid", nargs=2, type=int, default=[128, 192], metavar=("H", "W"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--rank", type=int, default=0, help="the rank whose profile is printed (ranks wait for each other)")
    parser.add_argument(
        "--slab", action="store_true",
        help="profile the floor instead: every rank runs the plain model on its own slab at once (no sharding)",
    )
    args = parser.parse_args()
    run_ranks(args.ranks, _rank_body, args)


if __name__ == "__main__":
    main()
