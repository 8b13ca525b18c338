"""Per-op dispatch overhead of small ops: plain tensor vs DTensor vs physics_dp ShardTensor.

Why: on small shards a wrapper subclass's Python dispatch costs more than the kernel itself, so
the per-op overhead (microseconds over a plain tensor) decides whether ShardTensor is usable for
many small ops.  The target is an overhead no larger than half of DTensor's.

Run it (any of):
    python benchmarks/dispatch_overhead.py                 # spawns 2 gloo ranks itself
    torchrun --nproc-per-node 2 benchmarks/dispatch_overhead.py
    python benchmarks/dispatch_overhead.py --json out.json --calls 4000 --profile 25

Each (op, local shard size, regime) case times the three implementations interleaved batch by
batch (rotating the order), so background load hits all three alike; the reported number is the
median over batches of the per-call average within a batch.  Regimes: ``no_autograd`` (inputs do
not require grad) and ``autograd`` (inputs require grad; only the forward op is timed, the graph
is built and dropped).

``--evict-mib N`` times each call alone right after streaming N MiB through a buffer of its own
(untimed), as a call meets the caches right after a large kernel in a training step.  On the
2-core VM, 64 MiB (both ranks together: twice its 32 MiB L3) made every implementation's calls
7-10x slower than back to back: ShardTensor's overhead over plain torch went from 3.6 to 35 us
for ``mul`` and from 15 to 106 us for ``view``, DTensor's alike.  The warm numbers rank the
implementations; the cold ones are what each op's Python costs inside a step.
"""

from __future__ import annotations

import os

if __name__ in ("__main__", "__mp_main__"):
    # Before torch is imported, so this process and the ranks it spawns get a 1-thread OpenMP
    # pool; only when run as a script, so importing the module (tests) changes no environment.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import cProfile
import gc
import io
import json
import operator
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import distribute_tensor as dtensor_distribute_tensor

from physics_dp.distributed import collectives
from physics_dp.shard_tensor import Shard, ShardTensor
from physics_dp.shard_tensor import distribute_tensor as shard_distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_processes import run_ranks  # noqa: E402

__all__ = [
    "OPS",
    "SIZES",
    "REGIMES",
    "IMPLS",
    "TARGET_RATIO",
    "global_inputs",
    "make_inputs",
    "local_value",
    "measure",
    "summarize",
    "format_table",
    "verdict",
    "format_verdict",
    "profile_case",
    "parse_args",
    "run_and_report",
    "main",
]

# name -> (callable, arity).  operator.add/mul are exactly ``x + y`` / ``x * y`` (Tensor.__add__).
OPS: dict[str, tuple[Callable[..., torch.Tensor], int]] = {
    "add": (operator.add, 2),
    "mul": (operator.mul, 2),
    "gelu": (F.gelu, 1),
    # every backward starts from one; models build masks and buffers with them
    "ones_like": (torch.ones_like, 1),
    # reshapes at module boundaries (attention heads, flattening for linear layers)
    "view": (lambda t: t.view(t.shape[0], 2, -1), 1),
}
# factories: their output starts no graph, whatever the regime
FACTORIES = frozenset({"ones_like"})
SIZES: tuple[int, ...] = (8, 64)
REGIMES: tuple[str, ...] = ("no_autograd", "autograd")
IMPLS: tuple[str, ...] = ("plain", "dtensor", "shardtensor")
TARGET_RATIO = 0.5  # ShardTensor overhead should be at most half of DTensor's


# ----- inputs ---------------------------------------------------------------------------------
def global_inputs(size: int, world: int, arity: int) -> list[torch.Tensor]:
    """Identical global tensors on every rank (fixed seed), ``(world*size, size)`` each."""
    generator = torch.Generator().manual_seed(1000 + size)
    return [torch.randn(world * size, size, generator=generator) for _ in range(arity)]


def make_inputs(
    impl: str, globals_: Sequence[torch.Tensor], mesh: DeviceMesh, requires_grad: bool
) -> list[torch.Tensor]:
    """This rank's inputs for one implementation; every one holds the same ``size x size`` slab."""
    world = mesh.size(0)
    coordinate = mesh.get_coordinate()[0]  # type: ignore[index]
    inputs: list[torch.Tensor] = []
    for tensor in globals_:
        if impl == "plain":
            rows = tensor.shape[0] // world
            value: torch.Tensor = tensor[coordinate * rows : (coordinate + 1) * rows].clone()
        elif impl == "dtensor":
            value = dtensor_distribute_tensor(tensor, mesh, [Shard(0)])
        elif impl == "shardtensor":
            value = shard_distribute_tensor(tensor, mesh, [Shard(0)])
        else:
            raise ValueError(f"unknown implementation {impl!r}")
        if requires_grad:
            value.requires_grad_(True)
        inputs.append(value)
    return inputs


def local_value(output: torch.Tensor) -> torch.Tensor:
    """The local slab of an output as a plain detached tensor (picklable, comparable)."""
    if isinstance(output, (DTensor, ShardTensor)):
        output = output.to_local()
    return output.detach().clone()


# ----- timing ---------------------------------------------------------------------------------
def _time_batch(fn: Callable[..., Any], args: Sequence[torch.Tensor], calls: int, evict: torch.Tensor | None = None) -> float:
    """Seconds per call over ``calls`` back-to-back calls (loop overhead is the same for every impl);
    with ``evict``, each call timed alone after a pass over that buffer (cold caches)."""
    loop = range(calls)
    if evict is not None:
        elapsed = 0.0
        for _ in loop:
            evict.add_(1.0)
            start = time.perf_counter()
            fn(*args)
            elapsed += time.perf_counter() - start
        return elapsed / calls
    start = time.perf_counter()
    for _ in loop:
        fn(*args)
    return (time.perf_counter() - start) / calls


def _barrier(mesh: DeviceMesh) -> None:
    """Start every case together on all ranks, so they compete for the cores the same way."""
    collectives.barrier(mesh.get_group(0))  # returns at once on one rank


def measure(
    mesh: DeviceMesh,
    *,
    ops: Sequence[str] = tuple(OPS),
    sizes: Sequence[int] = SIZES,
    regimes: Sequence[str] = REGIMES,
    warmup: int = 200,
    calls: int = 2000,
    batch_size: int = 100,
    return_outputs: bool = False,
    evict_mib: int = 0,
) -> dict[str, Any]:
    """Time every (op, size, regime) case for the three implementations on this rank.

    Collective over ``mesh`` (a 1-D mesh; every rank must call it).  Returns
    ``{"rank", "results": [row, ...]}``; a row holds the per-call medians in microseconds
    (``<impl>_us``) and the fastest batch's per-call time (``<impl>_min_us``).
    With ``return_outputs`` it also returns ``"outputs"``: for each case key ``op/size/regime``
    the local output slab of one call per implementation plus its type/placement/grad facts,
    so callers can check that the three implementations computed the same thing.
    gc is disabled while timing (as ``timeit`` does) so collections land outside the batches.
    ``evict_mib`` > 0 streams that many MiB before each timed call (see the module docstring).
    """
    if mesh.ndim != 1:
        raise ValueError("measure needs a 1-D device mesh")
    unknown = [op for op in ops if op not in OPS] + [r for r in regimes if r not in REGIMES]
    if unknown:
        raise ValueError(f"unknown ops/regimes {unknown}; choose from {list(OPS)} and {list(REGIMES)}")
    batch_size = max(1, min(batch_size, calls))
    batches = max(1, calls // batch_size)
    world = mesh.size(0)
    evict = torch.zeros(evict_mib * 2**18) if evict_mib > 0 else None  # float32: 2**18 per MiB
    results: list[dict[str, Any]] = []
    outputs: dict[str, dict[str, Any]] = {}
    gc_was_enabled = gc.isenabled()
    try:
        for op_name in ops:
            fn, arity = OPS[op_name]
            for size in sizes:
                globals_ = global_inputs(size, world, arity)
                for regime in regimes:
                    requires_grad = regime == "autograd"
                    inputs = {impl: make_inputs(impl, globals_, mesh, requires_grad) for impl in IMPLS}
                    for impl, args in inputs.items():
                        if tuple(local_value(args[0]).shape) != (size, size):
                            raise RuntimeError(f"{impl}: local shard is not {size}x{size}")
                    if return_outputs:
                        outputs[f"{op_name}/{size}/{regime}"] = {
                            impl: _describe_output(fn(*args)) for impl, args in inputs.items()
                        }
                    _barrier(mesh)
                    gc.collect()
                    gc.disable()
                    for impl in IMPLS:
                        _time_batch(fn, inputs[impl], warmup)
                    per_call: dict[str, list[float]] = {impl: [] for impl in IMPLS}
                    for b in range(batches):
                        shift = b % len(IMPLS)
                        for impl in IMPLS[shift:] + IMPLS[:shift]:
                            per_call[impl].append(_time_batch(fn, inputs[impl], batch_size, evict))
                    if gc_was_enabled:
                        gc.enable()
                    row: dict[str, Any] = {"op": op_name, "size": size, "regime": regime}
                    for impl in IMPLS:
                        row[f"{impl}_us"] = statistics.median(per_call[impl]) * 1e6
                    for impl in IMPLS:  # the fastest batch: a load-robust lower bound, JSON only
                        row[f"{impl}_min_us"] = min(per_call[impl]) * 1e6
                    row["batches"] = batches
                    row["calls_per_batch"] = batch_size
                    results.append(row)
    finally:
        if gc_was_enabled:
            gc.enable()
    report: dict[str, Any] = {"rank": dist.get_rank() if dist.is_initialized() else 0, "results": results}
    if return_outputs:
        report["outputs"] = outputs
    return report


def _describe_output(output: torch.Tensor) -> dict[str, Any]:
    """One output reduced to picklable facts: local value, wrapper type, placements, grad."""
    placements = getattr(output, "placements", None)
    return {
        "value": local_value(output),
        "type": type(output).__name__,
        "placements": repr(tuple(placements)) if placements is not None else None,
        "shape": tuple(output.shape),
        "requires_grad": output.requires_grad,
        "has_grad_fn": output.grad_fn is not None,
    }


# ----- reporting ------------------------------------------------------------------------------
def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with overheads (us over plain) and the ShardTensor/DTensor overhead ratio added."""
    rows = []
    for row in results:
        dt_over = row["dtensor_us"] - row["plain_us"]
        st_over = row["shardtensor_us"] - row["plain_us"]
        ratio = st_over / dt_over if dt_over > 0 else float("inf")
        rows.append({**row, "dtensor_overhead_us": dt_over, "shardtensor_overhead_us": st_over, "ratio": ratio})
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'op':<5} {'shard':>6} {'regime':<12} {'plain us':>9} {'DTensor us':>11} {'ShardT us':>10} "
        f"{'DT over':>8} {'ST over':>8} {'ST/DT':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['op']:<5} {str(r['size']) + 'x' + str(r['size']):>6} {r['regime']:<12} {r['plain_us']:>9.2f} "
            f"{r['dtensor_us']:>11.2f} {r['shardtensor_us']:>10.2f} {r['dtensor_overhead_us']:>8.2f} "
            f"{r['shardtensor_overhead_us']:>8.2f} {r['ratio']:>6.2f}"
        )
    return "\n".join(lines)


def verdict(rows: Sequence[dict[str, Any]], target: float = TARGET_RATIO) -> dict[str, Any]:
    """Whether ShardTensor's overhead is <= DTensor's in every case, and <= ``target`` x DTensor's."""
    worst = max(rows, key=lambda r: r["ratio"])
    not_better = [r for r in rows if r["ratio"] > 1.0]
    missing_target = [r for r in rows if r["ratio"] > target]
    return {
        "overhead_le_dtensor_everywhere": not not_better,
        "meets_half_target_everywhere": not missing_target,
        "cases": len(rows),
        "cases_above_dtensor": len(not_better),
        "cases_missing_target": len(missing_target),
        "worst": {
            k: worst[k] for k in ("op", "size", "regime", "ratio", "shardtensor_overhead_us", "dtensor_overhead_us")
        },
        "target_ratio": target,
    }


def format_verdict(v: dict[str, Any]) -> str:
    w, cases = v["worst"], v["cases"]
    le_dtensor = "YES" if v["overhead_le_dtensor_everywhere"] else "NO"
    half = "YES" if v["meets_half_target_everywhere"] else "NO"
    return (
        f"VERDICT: ShardTensor overhead <= DTensor overhead everywhere: "
        f"{le_dtensor} ({v['cases_above_dtensor']}/{cases} cases above); "
        f"meets target (<= {v['target_ratio']:.2f} x DTensor overhead) everywhere: "
        f"{half} ({v['cases_missing_target']}/{cases} cases miss it); "
        f"worst: {w['op']} {w['size']}x{w['size']} {w['regime']} ratio {w['ratio']:.2f} "
        f"({w['shardtensor_overhead_us']:.1f} us vs {w['dtensor_overhead_us']:.1f} us)"
    )


# ----- profiling ------------------------------------------------------------------------------
def profile_case(mesh: DeviceMesh, op: str, size: int, regime: str, calls: int = 5000, top: int = 25) -> str:
    """cProfile of ``calls`` ShardTensor calls of one case: the top functions by own time, as text.

    cProfile inflates Python-heavy paths, so read it for *where* the time goes, not how much.
    """
    fn, arity = OPS[op]
    inputs = make_inputs("shardtensor", global_inputs(size, mesh.size(0), arity), mesh, regime == "autograd")
    _time_batch(fn, inputs, 200)
    profiler = cProfile.Profile()
    profiler.enable()
    _time_batch(fn, inputs, calls)
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    return stream.getvalue()


# ----- entry points ---------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls per implementation and case")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per implementation and case")
    parser.add_argument("--batch-size", type=int, default=100, help="calls per timed batch")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="local shard edge lengths")
    parser.add_argument("--evict-mib", type=int, default=0, metavar="MIB",
                        help="stream this many MiB before each timed call, as after a large kernel (e.g. 64; default 0: warm caches)")
    parser.add_argument("--json", metavar="PATH", help="write all ranks' results and the verdict here")
    parser.add_argument("--profile", type=int, metavar="TOP", default=0,
                        help="also cProfile ShardTensor on the worst-ratio case (rank 0), top N lines")
    return parser.parse_args(argv)


def run_and_report(mesh: DeviceMesh, args: argparse.Namespace) -> str | None:
    """Measure on every rank of ``mesh``, gather, and on rank 0 print (and return) the report.

    Collective; kept apart from process-group set-up so tests can run it on an existing pool.
    """
    report = measure(mesh, ops=args.ops, sizes=args.sizes, warmup=args.warmup, calls=args.calls,
                     batch_size=args.batch_size, evict_mib=args.evict_mib)
    group = mesh.get_group(0)
    gathered: list[Any] = [None] * mesh.size(0)
    dist.all_gather_object(gathered, report, group=group)
    text = None
    if mesh.get_coordinate()[0] == 0:  # type: ignore[index]
        rows = summarize(report["results"])
        summary = verdict(rows)
        lines = [
            f"dispatch overhead, torch {torch.__version__}, {mesh.size(0)} ranks ({dist.get_backend(group)}), "
            f"{torch.get_num_threads()} thread(s) each, {args.calls} calls in batches of {args.batch_size}, "
            + (f"each after streaming {args.evict_mib} MiB, " if args.evict_mib else "")
            + "rank 0 medians, us per op",
            format_table(rows),
        ]
        for other in gathered[1:]:
            ratios = ", ".join(f"{r['ratio']:.2f}" for r in summarize(other["results"]))
            lines.append(f"rank {other['rank']} ST/DT ratios (same row order): {ratios}")
        lines.append(format_verdict(summary))
        if args.json:
            payload = {
                "torch": torch.__version__,
                "world_size": mesh.size(0),
                "settings": {k: getattr(args, k) for k in ("warmup", "calls", "batch_size", "evict_mib", "ops", "sizes")},
                "ranks": [{"rank": g["rank"], "rows": summarize(g["results"])} for g in gathered],
                "verdict": summary,
            }
            with open(args.json, "w") as handle:
                json.dump(payload, handle, indent=2)
            lines.append(f"wrote {args.json}")
        if args.profile:
            worst = summary["worst"]
            lines.append(f"\ncProfile of ShardTensor, {worst['op']} {worst['size']}x{worst['size']} {worst['regime']}:")
            lines.append(profile_case(mesh, worst["op"], worst["size"], worst["regime"], top=args.profile))
        text = "\n".join(lines)
        print(text, flush=True)
    dist.barrier(group=group)
    return text


def _rank_body(args: argparse.Namespace) -> None:
    """Every rank's part once the job is up (under torchrun or :func:`rank_processes.run_ranks`)."""
    from physics_dp.distributed import DistributedManager, build_device_mesh

    run_and_report(build_device_mesh((DistributedManager().world_size,)), args)


def _torchrun_rank(args: argparse.Namespace) -> None:
    """Under torchrun: join its job on gloo, run the body, tear down."""
    from physics_dp.distributed import DistributedManager

    torch.set_num_threads(1)
    DistributedManager.initialize(backend="gloo")
    try:
        _rank_body(args)
    finally:
        DistributedManager().cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or any env:// launcher)
        _torchrun_rank(args)
        return
    run_ranks(args.nproc, _rank_body, args, backend="gloo")


if __name__ == "__main__":
    main(sys.argv[1:])
