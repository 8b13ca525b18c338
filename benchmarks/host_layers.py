"""The host cost of each layer a sharded op passes through, warm and with cold caches.

Why: inside a training step every op's host path runs right after large kernels have streamed
megabytes through the caches.  There the first touch of each code path pays and repeats hardly do
(ten small ops in a row cost 2.5x their warm time, one wrapper creation 14x; ``docs/benchmarks.md``,
twenty-ninth pass), so an op's cost in a step follows the number of distinct layers it passes
through: dispatch, conversions, its autograd Function, wrappers, collectives.  This prints each
such layer alone, so that a change to one can be weighed before it is made.

    python benchmarks/host_layers.py                     # 2 ranks, 100 calls, 64 MiB streamed
    python benchmarks/host_layers.py --calls 300 --evict-mib 32

Per primitive, rank 0 prints the median microseconds per call back to back ("warm") and with
``--evict-mib`` MiB streamed through a buffer of the rank's own before each call, untimed
("cold").  Every rank runs every call (the collective pairs up); a barrier precedes each timed
collective so that the time is its own, not the peer's lag.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_processes import run_ranks  # noqa: E402

SHAPE = (1, 64, 8, 8)  # global; the slabs are (1, 64, 8 / ranks, 8): kernels near zero


def primitives(mesh: Any) -> dict[str, tuple[Callable[[], Any], bool]]:
    """Name -> (a call of that layer alone, whether it is a collective) on this rank's ``mesh``."""
    from physics_dp.distributed import collectives
    from physics_dp.distributed.tracing import is_tracing
    from physics_dp.ops._local import local_input, wrap_local_as
    from physics_dp.shard_tensor import Shard, ShardTensor, distribute_tensor

    generator = torch.Generator().manual_seed(0)
    sharded = distribute_tensor(torch.randn(SHAPE, generator=generator), mesh, [Shard(2)])
    slab = sharded.to_local().clone()
    needs_grad = sharded.detach().requires_grad_(True)
    weight = torch.randn(SHAPE[1], SHAPE[1], 1, 1, generator=generator)
    stats = torch.randn(17, dtype=torch.float64, generator=generator)
    group = mesh.get_group(0)
    return {
        "plain mul": (lambda: slab * 2.0, False),
        "ShardTensor mul, no autograd": (lambda: sharded * 2.0, False),
        "one ShardTensor wrapper": (lambda: ShardTensor(slab, sharded._spec), False),
        "slab out and back, autograd": (lambda: wrap_local_as(local_input(needs_grad) * 1.0, needs_grad._spec), False),
        "all-reduce of 17 float64": (lambda: collectives.all_reduce(stats, "sum", group), True),
        "ten float64 muls in a row": (lambda: [stats * 2.0 for _ in range(10)], False),
        "ten is_tracing() in a row": (lambda: [is_tracing() for _ in range(10)], False),
        "plain 1x1 conv": (lambda: F.conv2d(slab, weight), False),
        "sharded 1x1 conv": (lambda: F.conv2d(sharded, weight), False),
    }


def _timed_calls(call: Callable[[], Any], calls: int, collective: bool, evict: torch.Tensor | None) -> tuple[float, Any]:
    """Median seconds of ``calls`` calls, each after streaming ``evict`` if given; and the last result."""
    import torch.distributed as dist

    result = None
    for _ in range(5):
        result = call()
    samples = []
    for _ in range(calls):
        if evict is not None:
            evict.add_(1.0)
        if collective:
            dist.barrier()
        start = time.perf_counter()
        result = call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), result


def measure(mesh: Any, calls: int, evict_mib: int) -> list[dict[str, Any]]:
    """Per primitive: name, warm and cold microseconds, and the type of what the call returned."""
    evict = torch.zeros(evict_mib * 2**18)  # float32: evict_mib MiB
    rows = []
    for name, (call, collective) in primitives(mesh).items():
        warm, result = _timed_calls(call, calls, collective, None)
        cold, _ = _timed_calls(call, calls, collective, evict)
        rows.append({"name": name, "warm_us": warm * 1e6, "cold_us": cold * 1e6, "returns": type(result).__name__})
    return rows


def _rank_body(args: argparse.Namespace) -> list[dict[str, Any]]:
    from physics_dp.distributed import DistributedManager
    from physics_dp.distributed.host_memory import keep_freed_memory

    keep_freed_memory()  # as the trainer does by default
    manager = DistributedManager()
    mesh = manager.initialize_mesh((manager.world_size,), ("domain",))
    return measure(mesh, args.calls, args.evict_mib)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| layer | warm us | cold us | cold / warm |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {r['warm_us']:.1f} | {r['cold_us']:.1f} | {r['cold_us'] / r['warm_us']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=100, help="timed calls per primitive and regime (median)")
    parser.add_argument("--evict-mib", type=int, default=64, help="MiB streamed before each cold call")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.calls < 1 or args.evict_mib < 1:
        parser.error("--ranks must be >= 2, --calls and --evict-mib >= 1")
    rows = run_ranks(args.ranks, _rank_body, args)[0]
    text = (f"Host cost per layer, rank 0 of {args.ranks}, global {SHAPE}, median of {args.calls} calls; "
            f"cold: after {args.evict_mib} MiB streamed\n\n{format_table(rows)}")
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
