"""Strong scaling of the core sharded ops: one process vs. N ranks at the same global size.

For conv2d, group_norm, attention (ring) and fft2, forward + backward, this prints in one run:
the median step time of plain torch in one process with 1 thread and with N threads, of the
ShardTensor version on N ranks x 1 thread, the speedup of N ranks over one process given the
same N threads, and the bytes each rank sent per step (from physics_dp's counted collectives).

    python benchmarks/ops_scaling.py [--ranks 2] [--repeats 10] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

CASES: dict[str, dict] = {
    "conv2d 3x3 (1,32,256,256)": {"shape": (1, 32, 256, 256), "dim": 2},
    "group_norm 8 groups (1,64,256,256)": {"shape": (1, 64, 256, 256), "dim": 2},
    "attention (1,4,4096,32) ring": {"shape": (1, 4, 4096, 32), "dim": 2},
    "fft2 (4,16,256,256)": {"shape": (4, 16, 256, 256), "dim": 2},
}


def _build(name: str, seed: int = 0) -> tuple[Callable, list[torch.Tensor]]:
    """The op as a function of its inputs, and global inputs (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    shape = CASES[name]["shape"]
    x = torch.randn(shape, generator=gen)
    if name.startswith("conv2d"):
        weight = torch.randn(shape[1], shape[1], 3, 3, generator=gen) * 0.05
        return (lambda t: F.conv2d(t, weight, padding=1)), [x]
    if name.startswith("group_norm"):
        return (lambda t: F.group_norm(t, 8)), [x]
    if name.startswith("attention"):
        return (lambda t: F.scaled_dot_product_attention(t, t, t)), [x]
    return (lambda t: torch.fft.fft2(t).abs()), [x]


def _time(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _single_process(threads: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    results = {}
    for name in CASES:
        fn, inputs = _build(name)
        leaf = inputs[0].clone().requires_grad_(True)

        def step() -> None:
            fn(leaf).sum().backward()

        results[name] = _time(step, repeats)
    return results


def _sharded_worker(rank: int, world: int, port: int, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from physics_dp.distributed import DistributedManager
    from physics_dp.distributed.collectives import count_communication
    from physics_dp.shard_tensor import Shard, distribute_tensor

    DistributedManager.initialize()
    mesh = DistributedManager().initialize_mesh((world,), ("domain",))
    results = {}
    for name, case in CASES.items():
        fn, inputs = _build(name)
        x = distribute_tensor(inputs[0], mesh, [Shard(case["dim"])]).detach().requires_grad_(True)

        def step() -> None:
            fn(x).sum().backward()

        dist.barrier()
        seconds = _time(step, repeats)
        with count_communication() as log:
            step()
        results[name] = {"seconds": seconds, "bytes_sent": log.bytes_sent, "collectives": log.calls}
    queue.put((rank, results))
    DistributedManager().cleanup()


def _sharded(world: int, repeats: int) -> dict[str, dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sharded_worker, args=(r, world, port, repeats, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    merged = {}
    for name in CASES:
        merged[name] = {
            "seconds": max(per_rank[r][name]["seconds"] for r in per_rank),  # the slowest rank sets the pace
            "bytes_sent": max(per_rank[r][name]["bytes_sent"] for r in per_rank),
            "collectives": max(per_rank[r][name]["collectives"] for r in per_rank),
        }
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    one_thread = _single_process(1, args.repeats)
    n_threads = _single_process(args.ranks, args.repeats)
    sharded = _sharded(args.ranks, args.repeats)
    header = f"{'op (fwd+bwd)':38} {'1 proc x1 thr':>13} {f'1 proc x{args.ranks} thr':>13} {f'{args.ranks} ranks x1':>11} {'speedup vs 1x1':>15} {f'vs 1x{args.ranks}':>8} {'MiB sent/rank':>14} {'collectives':>11}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in CASES:
        s = sharded[name]
        row = {
            "op": name,
            "single_1thread_s": one_thread[name],
            f"single_{args.ranks}threads_s": n_threads[name],
            f"sharded_{args.ranks}ranks_s": s["seconds"],
            "speedup_vs_1thread": one_thread[name] / s["seconds"],
            "speedup_vs_same_threads": n_threads[name] / s["seconds"],
            "bytes_sent_per_rank": s["bytes_sent"],
            "collectives_per_rank": s["collectives"],
        }
        rows.append(row)
        print(
            f"{name:38} {one_thread[name] * 1e3:11.1f}ms {n_threads[name] * 1e3:11.1f}ms {s['seconds'] * 1e3:9.1f}ms "
            f"{row['speedup_vs_1thread']:14.2f}x {row['speedup_vs_same_threads']:7.2f}x {s['bytes_sent'] / 2**20:14.2f} {s['collectives']:11d}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
