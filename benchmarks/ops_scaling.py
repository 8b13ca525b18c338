"""Strong scaling of every sharded op family: N ranks against the floor and against one process.

For each op (forward, then backward from a cotangent of ones, at one global size; a loss such as
``.sum()`` would add one all-reduce per step that is not the op's) it prints, in one run:

- ``sharded``: the ShardTensor op on N ranks x 1 thread (slowest rank, median of the time between two
  barriers through shared memory: gloo's barrier adds 0.3-4 ms at random, more than many ops cost);
- ``slab``: the plain torch op on one rank's slab widened by the halo rows its stencil reads, in
  the same rank processes, interleaved with the sharded runs (the floor: the work a rank must do);
- ``slab alone``, ``1x1`` / ``1xN``: the plain op on rank 0's slab, and on the whole grid with 1
  and with N threads, each run by rank 0 while the other ranks wait in gloo's barrier (a socket
  wait: their cores stay idle).  They take turns, right after the case's sharded runs, so that
  every column of a row comes from the same minutes (measured in a separate process before the
  ranks, the one-thread baseline moved one op's speedup from 1.0x to 2.4x between runs on the
  2-core VM) and no run finds its own data still in the caches, as the sharded runs do not;
- the ratio sharded / slab (overhead), the speedups of N ranks over one process, and the bytes and
  collectives each rank issued per step (physics_dp's counted collectives);
- ``at most``: 1x1 / slab, the speedup N ranks would reach with no overhead at all.  It falls
  short of N where the ranks running side by side slow each other down (slab against slab alone:
  on the 2-core VM, memory-bound ops share the memory bandwidth), which no sharding code can change.

    python benchmarks/ops_scaling.py [--ranks 2] [--repeats 25] [--ops conv,group_norm] [--json out.json] [--channels-last]

With ``PHYSICS_DP_FUSED_CPU_KERNELS=0`` the norms run on torch's stock kernels, the path a GPU (or a
CPU rank without a C++ compiler) takes.

Every rank first keeps freed host memory, as the trainer does by default
(``physics_dp.distributed.host_memory``): otherwise a freed 16 MiB result is unmapped and the
next step's allocation faults its pages in again, which costs more than a memory-bound op itself
and depends on which tensors happen to be alive, not on the op.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from physics_dp.distributed.host_memory import keep_freed_memory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_processes import run_ranks  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One op at one global size; ``halo`` is the rows (before, after) the op reads beyond a slab."""

    name: str
    shape: tuple[int, ...]
    dim: int
    halo: tuple[int, int]
    kind: str  # "compute" (target 1.15x the slab) or "memory" (target 1.3x)
    build: Callable[[torch.Generator, tuple[int, ...], torch.memory_format], Callable]  # the op as a function of its input
    # (N, C, H, W) with channels at dim 1: ``--channels-last`` lays it (and a conv's weight) out channels last
    # attention: a rank's queries attend to every key, so its floor is the slab's queries
    # against the whole sequence, not the slab against itself
    slab_attends_to_all: bool = False
    has_channels: bool = True


def _weight(gen: torch.Generator, shape: tuple[int, ...], memory_format: torch.memory_format, grad: bool) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 0.05).contiguous(memory_format=memory_format).requires_grad_(grad)


def _conv(weight_grad: bool, stride: int = 1) -> Callable:
    def build(gen: torch.Generator, shape: tuple[int, ...], memory_format: torch.memory_format):
        weight = _weight(gen, (shape[1], shape[1], 3, 3), memory_format, weight_grad)
        return lambda t: F.conv2d(t, weight, stride=stride, padding=1)

    return build


def _conv_transpose(gen: torch.Generator, shape: tuple[int, ...], memory_format: torch.memory_format):
    weight = _weight(gen, (shape[1], shape[1], 4, 4), memory_format, True)
    return lambda t: F.conv_transpose2d(t, weight, stride=2, padding=1)


def _group_norm(gen: torch.Generator, shape: tuple[int, ...], memory_format: torch.memory_format):
    weight, bias = torch.ones(shape[1], requires_grad=True), torch.zeros(shape[1], requires_grad=True)
    return lambda t: F.group_norm(t, 8, weight, bias)


def _batch_norm(gen: torch.Generator, shape: tuple[int, ...], memory_format: torch.memory_format):
    weight, bias = torch.ones(shape[1], requires_grad=True), torch.zeros(shape[1], requires_grad=True)
    return lambda t: F.batch_norm(t, None, None, weight, bias, training=True)


def _layer_norm(gen: torch.Generator, shape: tuple[int, ...], memory_format: torch.memory_format):
    return lambda t: F.layer_norm(t, t.shape[1:])


def _plain(fn: Callable) -> Callable:
    return lambda gen, shape, memory_format: fn


def _attention(t: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(t, t, t)


CASES = [
    Case("conv2d 3x3, no weight grad", (1, 32, 256, 256), 2, (1, 1), "compute", _conv(False)),
    Case("conv2d 3x3, weight grad", (1, 32, 256, 256), 2, (1, 1), "compute", _conv(True)),
    Case("conv2d 3x3 stride 2, weight grad", (1, 32, 256, 256), 2, (1, 0), "compute", _conv(True, stride=2)),
    Case("conv_transpose2d 4x4 s2", (1, 32, 128, 128), 2, (1, 1), "compute", _conv_transpose),
    Case("group_norm 8 groups", (1, 64, 256, 256), 2, (0, 0), "memory", _group_norm),
    Case("batch_norm (training)", (4, 32, 128, 128), 2, (0, 0), "memory", _batch_norm),
    Case("layer_norm over (C,H,W)", (4, 32, 128, 128), 2, (0, 0), "memory", _layer_norm),
    Case("avg_pool2d k2", (1, 32, 256, 256), 2, (0, 0), "memory", _plain(lambda t: F.avg_pool2d(t, 2))),
    Case("max_pool2d k3 s1 p1", (1, 32, 256, 256), 2, (1, 1), "memory", _plain(lambda t: F.max_pool2d(t, 3, 1, 1))),
    Case(
        "interpolate bilinear x2", (1, 32, 128, 128), 2, (1, 1), "memory",
        _plain(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear")),
    ),
    Case(
        "unfold 3x3 p1, fold back", (1, 16, 128, 128), 2, (1, 1), "memory",
        _plain(lambda t: F.fold(F.unfold(t, 3, padding=1), t.shape[-2:], 3, padding=1)),
    ),
    Case("pad circular 2", (1, 32, 256, 256), 2, (2, 2), "memory", _plain(lambda t: F.pad(t, (2, 2, 2, 2), mode="circular"))),
    Case("fft2, then abs", (4, 16, 256, 256), 2, (0, 0), "memory", _plain(lambda t: torch.fft.fft2(t).abs())),
    Case(
        "attention (1,4,4096,32) ring", (1, 4, 4096, 32), 2, (0, 0), "compute", _plain(_attention), slab_attends_to_all=True,
        has_channels=False,
    ),
    Case("mean of squares over H,W", (4, 32, 256, 256), 2, (0, 0), "memory", _plain(lambda t: t.square().mean((2, 3)))),
    Case(
        "pointwise chain silu(2x+1)*x", (4, 32, 256, 256), 2, (0, 0), "memory",
        _plain(lambda t: F.silu(t * 2 + 1) * t),
    ),
]
TARGETS = {"compute": 1.15, "memory": 1.3}
# untimed steps per case first: the heap grows to the case's peak and the caches settle (with one,
# the first case of a run measured up to 1.6x its later runs on the 2-core VM)
WARMUP = 3


def _backward(out: torch.Tensor) -> None:
    """Backward from a cotangent of ones laid out like ``out``: the op's own cost, no loss all-reduce."""
    out.backward(torch.ones_like(out))


def _slab_with_halo(x: torch.Tensor, case: Case, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    lo, hi = max(0, start - case.halo[0]), min(x.shape[case.dim], start + sizes[rank] + case.halo[1])
    return x.narrow(case.dim, lo, hi - lo).contiguous(memory_format=_layout(x))


def _alone_on_rank_0(step: Callable[[], None], threads: int, rank: int) -> float:
    """Seconds of one ``step`` on rank 0 with ``threads`` threads while every other rank blocks in
    gloo's barrier (its socket wait leaves the core idle); 0.0 on the other ranks."""
    import torch.distributed as dist

    dist.barrier()
    elapsed = 0.0
    if rank == 0:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        torch.set_num_threads(1)
    dist.barrier()
    return elapsed


def _layout(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() else torch.contiguous_format


def _rank_body(names: list[str], repeats: int, channels_last: bool) -> dict[str, dict]:
    """This rank's medians, bytes and collectives for each named case, sharded and on its slab."""
    from physics_dp.distributed import DistributedManager
    from physics_dp.distributed.collectives import barrier, count_communication
    from physics_dp.shard_tensor import Shard, distribute_tensor
    from physics_dp.shard_tensor.spec import balanced_sizes

    keep_freed_memory()
    manager = DistributedManager()
    rank, world = manager.rank, manager.world_size
    mesh = manager.initialize_mesh((world,), ("domain",))
    results = {}
    for case in (c for c in CASES if c.name in names):
        gen = torch.Generator().manual_seed(0)
        memory_format = torch.channels_last if channels_last and case.has_channels else torch.contiguous_format
        full = torch.randn(case.shape, generator=gen).contiguous(memory_format=memory_format)
        fn = case.build(gen, case.shape, memory_format)
        sharded = distribute_tensor(full, mesh, [Shard(case.dim)]).detach().requires_grad_(True)
        slab = _slab_with_halo(full, case, list(balanced_sizes(case.shape[case.dim], world)), rank).requires_grad_(True)

        def sharded_step() -> None:
            _backward(fn(sharded))

        keys = full.clone().requires_grad_(True)

        def slab_step() -> None:
            _backward(F.scaled_dot_product_attention(slab, keys, keys) if case.slab_attends_to_all else fn(slab))

        whole = full.clone().requires_grad_(True)

        def whole_step() -> None:
            _backward(fn(whole))

        samples: dict[str, list[float]] = {"sharded_s": [], "slab_s": []}
        for _ in range(WARMUP + repeats):  # interleaved, so background load hits both alike
            for key, step in (("sharded_s", sharded_step), ("slab_s", slab_step)):
                barrier()
                start = time.perf_counter()
                step()
                barrier()
                samples[key].append(time.perf_counter() - start)
        # then rank 0's runs alone, in turn too; after the sharded runs, not between them: a
        # multi-threaded run's spinning threads and cache footprint slowed the next sharded step up to 2.6x
        alone = (("slab_alone_s", slab_step, 1), ("single_1thread_s", whole_step, 1), ("single_nthreads_s", whole_step, world))
        samples.update((key, []) for key, _, _ in alone)
        for _ in range(WARMUP + repeats):
            for key, step, threads in alone:
                samples[key].append(_alone_on_rank_0(step, threads, rank))
        with count_communication() as log:
            sharded_step()
        results[case.name] = {key: statistics.median(values[WARMUP:]) for key, values in samples.items()}
        results[case.name].update(bytes_sent=log.bytes_sent, collectives=log.calls)
    return results


def _measured(cases: list[Case], world: int, repeats: int, channels_last: bool) -> dict[str, dict]:
    """Each case's numbers on the slowest rank (the largest of each value over the ranks; the
    single-process times come from rank 0, the others report 0)."""
    per_rank = run_ranks(world, _rank_body, [c.name for c in cases], repeats, channels_last)
    return {case.name: {key: max(r[case.name][key] for r in per_rank) for key in per_rank[0][case.name]} for case in cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25, help="timed steps per case (median; default 25)")
    parser.add_argument("--ops", default="", help="comma-separated substrings of op names to run (default: all)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--channels-last", action="store_true", help="inputs (and conv weights) channels last, but attention's")
    args = parser.parse_args()
    wanted = [w.strip() for w in args.ops.split(",") if w.strip()]
    cases = [c for c in CASES if not wanted or any(w in c.name for w in wanted)]
    measured = _measured(cases, args.ranks, args.repeats, args.channels_last)
    n = args.ranks
    header = (
        f"| op (fwd+bwd), global shape | {n} ranks sharded | slab + halo | sharded/slab | target | slab alone | "
        f"1 proc x1 thr | 1 proc x{n} thr | speedup vs x1 | at most | vs x{n} | MiB sent/rank | collectives |"
    )
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    rows = []
    for case in cases:
        s = measured[case.name]
        row = {
            "op": case.name,
            "shape": case.shape,
            "sharded_s": s["sharded_s"],
            "slab_s": s["slab_s"],
            "overhead": s["sharded_s"] / s["slab_s"],
            "target": TARGETS[case.kind],
            "slab_alone_s": s["slab_alone_s"],
            "single_1thread_s": s["single_1thread_s"],
            f"single_{n}threads_s": s["single_nthreads_s"],
            "speedup_vs_1thread": s["single_1thread_s"] / s["sharded_s"],
            "speedup_vs_1thread_at_most": s["single_1thread_s"] / s["slab_s"],
            "speedup_vs_same_threads": s["single_nthreads_s"] / s["sharded_s"],
            "bytes_sent_per_rank": s["bytes_sent"],
            "collectives_per_rank": s["collectives"],
        }
        rows.append(row)
        ms = {key: f"{s[key] * 1e3:.1f} ms" for key in ("sharded_s", "slab_s", "slab_alone_s", "single_1thread_s", "single_nthreads_s")}
        print(
            f"| {case.name} {case.shape} | {ms['sharded_s']} | {ms['slab_s']} | {row['overhead']:.2f}x | <= {row['target']:.2f} | "
            f"{ms['slab_alone_s']} | {ms['single_1thread_s']} | {ms['single_nthreads_s']} | {row['speedup_vs_1thread']:.2f}x | "
            f"{row['speedup_vs_1thread_at_most']:.2f}x | {row['speedup_vs_same_threads']:.2f}x | "
            f"{s['bytes_sent'] / 2**20:.2f} | {s['collectives']} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
