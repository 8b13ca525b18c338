"""Peak memory per rank and step time of the StormCast regression U-Net training step, 1 to N domain ranks.

Why: domain parallelism exists to fit fields that do not fit one device, so what must shrink with
N is each rank's activation memory (parameters and optimizer state are replicated under
``data_parallel="none"``).  The target is an activation peak per rank of at most 1.1/N of the
1-rank peak.  One run prints, for a plain process (no ShardTensor; 1 thread and N threads) and
for N = 1, 2, 4 ranks x 1 thread: the median step time and its ratio to both plain references,
parameter / gradient / optimizer-state memory, the step's peak of live allocations with and
without the parameter gradients, the activation ratio to the 1-rank peak, and the bytes each rank
sent per step.

    python benchmarks/model_memory.py                         # 256x384 grid, ranks 1 2 4
    python benchmarks/model_memory.py --grid 128 192 --ranks 1 2 --steps 3 --json out.json
    python benchmarks/model_memory.py --data-parallel none fsdp

One step: ``zero_grad(set_to_none=True)``, forward, ``((out - target)**2).mean()``, backward,
AdamW step.  Memory comes from one extra step under the autograd profiler with ``profile_memory``:
the profiler records every allocation and free of the device's allocator with its address; the
running sum over the step is the live memory the step added, and parameter gradients are told
apart by the storages ``.grad`` holds afterwards (see docs/benchmarks.md).  Ranks are spawned
here (one gloo or nccl process group per rank count), with one thread each; on CUDA every rank
needs its own GPU, and rank counts above the GPU count are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.resources
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch._C._profiler import _EventType
from torch.autograd.profiler import profile

from physics_dp.distributed.collectives import barrier
from physics_dp.distributed.host_memory import keep_freed_memory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_processes import run_ranks  # noqa: E402

__all__ = [
    "TARGET_SLACK",
    "StepMemory",
    "step_memory_from_events",
    "regression_options",
    "global_batch",
    "build_model",
    "profile_step_memory",
    "training_step",
    "measure_step",
    "plain_reference",
    "summarize",
    "format_table",
    "parse_args",
    "main",
]

TARGET_SLACK = 1.10  # activation peak per rank <= 1.10 * (1-rank peak) / N
MIB = 2**20


# ----- model and data ------------------------------------------------------------------------
def regression_options(size: str = "lite") -> dict[str, Any]:
    """The ``regression`` block of the shipped ``configs/model/<size>.yaml``."""
    text = importlib.resources.files("physics_dp.configs").joinpath(f"model/{size}.yaml").read_text()
    return dict(yaml.safe_load(text)["regression"])


def global_batch(
    batch: int, state_channels: int, cond_channels: int, grid: Sequence[int], seed: int = 0
) -> dict[str, torch.Tensor]:
    """State, condition and target on the whole grid, identical on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(seed)
    height, width = grid
    return {
        "state": torch.randn(batch, state_channels, height, width, generator=gen),
        "condition": torch.randn(batch, cond_channels, height, width, generator=gen),
        "target": torch.randn(batch, state_channels, height, width, generator=gen),
    }


def build_model(grid: Sequence[int], state_channels: int, cond_channels: int, size: str = "lite", seed: int = 0) -> torch.nn.Module:
    """The StormCast regression U-Net with the ``size`` config, same weights for a given seed."""
    from physics_dp.models import build_regression_unet

    torch.manual_seed(seed)
    return build_regression_unet(
        grid_shape=tuple(grid),
        in_channels=state_channels,
        out_channels=state_channels,
        cond_channels=cond_channels,
        options=regression_options(size),
    )


# ----- memory ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepMemory:
    """Live allocations a step added on one device, in bytes, relative to its start.

    ``activation_peak`` leaves out the parameter gradients the step creates (replicated per rank
    under ``"none"``); it covers saved activations, activation gradients, temporaries and
    communication buffers.  ``end_live`` should be about ``gradients_created``: more means the
    step kept something alive (a cache, a leak).
    """

    step_peak: int
    activation_peak: int
    end_live: int
    gradients_created: int
    allocations: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_step(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], parameters: Sequence[torch.nn.Parameter] | None = None
) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], torch.optim.Optimizer]:
    """The training step every script here times, as a closure returning (output, detached loss),
    and its optimizer: ``zero_grad(set_to_none=True)``, forward, ``((out - target)**2).mean()``,
    backward, AdamW step over ``parameters`` (default: the model's)."""
    optimizer = torch.optim.AdamW(model.parameters() if parameters is None else parameters, lr=1e-4)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        optimizer.zero_grad(set_to_none=True)
        out = model(inputs["state"], inputs["condition"])
        loss = ((out - inputs["target"]) ** 2).mean()
        loss.backward()
        optimizer.step()
        return out, loss.detach()

    return step, optimizer


def _allocation_events(prof: profile, device: torch.device) -> list[tuple[int, int, int]]:
    """(time ns, signed bytes, address) of every allocation / free on ``device``, in time order."""
    events = []
    stack = list(prof.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag != _EventType.Allocation:
            continue
        fields = event.extra_fields
        if fields.device.type != device.type or (device.type == "cuda" and fields.device.index != device.index):
            continue
        events.append((event.start_time_ns, int(fields.alloc_size), int(fields.ptr)))
    events.sort()
    return events


def step_memory_from_events(events: Sequence[tuple[int, int, int]], gradient_ptrs: set[int]) -> StepMemory:
    """Fold time-ordered (time, signed bytes, address) allocator events into a :class:`StepMemory`.

    Only blocks allocated inside the window count: a free of an address the window did not
    allocate (a tensor from before the step, sized only if an earlier profiling session saw it)
    is ignored, so the result is the memory the step itself added.  A free the profiler missed
    (it follows only threads it started on, not gloo's) is inferred when the allocator hands the
    same address out again.  A block is a gradient if it is the last allocation at an address in
    ``gradient_ptrs``.
    """
    last_alloc_at = {ptr: index for index, (_, nbytes, ptr) in enumerate(events) if nbytes > 0}
    gradient_allocs = {last_alloc_at[ptr] for ptr in gradient_ptrs if ptr in last_alloc_at}
    blocks: dict[int, int] = {}
    live = grads = step_peak = activation_peak = allocations = 0
    for index, (_, nbytes, ptr) in enumerate(events):
        if nbytes > 0:
            live += nbytes - blocks.get(ptr, 0)
            blocks[ptr] = nbytes
            allocations += 1
            if index in gradient_allocs:
                grads += nbytes
        elif ptr in blocks:
            live -= blocks.pop(ptr)
        step_peak = max(step_peak, live)
        activation_peak = max(activation_peak, live - grads)
    return StepMemory(step_peak, activation_peak, live, grads, allocations)


def profile_step_memory(
    step: Callable[[], None], gradients: Callable[[], Sequence[torch.Tensor]], device: torch.device
) -> StepMemory:
    """Run ``step`` once under the profiler and return the live memory it added (see StepMemory).

    ``gradients()`` is called after the step and returns the tensors the step left in ``.grad``.
    Call ``zero_grad(set_to_none=True)`` before, not inside, ``step``: old gradients freed inside
    would not be credited (they were allocated before the window).
    """
    gc.collect()  # a collection inside the window would free unrelated objects mid-step
    # The autograd profiler directly: torch.profiler.profile's first start imports torch._inductor
    # (seconds per process), which this measurement does not need.
    with profile(use_cpu=True, use_device="cuda" if device.type == "cuda" else None, profile_memory=True, use_kineto=True) as prof:
        step()
        _sync(device)
    gradient_ptrs = {_local(g).untyped_storage().data_ptr() for g in gradients()}
    return step_memory_from_events(_allocation_events(prof, device), gradient_ptrs)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds: a DTensor's local shard (parameters under FSDP), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _local_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


# ----- one configuration -----------------------------------------------------------------------
def measure_step(
    model: torch.nn.Module,
    parameters: Sequence[torch.nn.Parameter],
    inputs: dict[str, torch.Tensor],
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    before_each: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Time ``steps`` training steps after ``warmup``, then profile one for memory and traffic.

    ``before_each`` runs untimed before every step (the ranks' barrier).  Returns the median
    step time, the per-step samples, the loss and output type / placements of the profiled
    step, parameter / gradient / optimizer-state bytes and the :class:`StepMemory` fields.
    """
    from physics_dp.distributed.collectives import count_communication

    if warmup < 1:
        raise ValueError("warmup must be >= 1: the first AdamW step allocates the optimizer state, which is not step memory")
    train, optimizer = training_step(model, inputs, parameters)
    last: dict[str, Any] = {}

    def recorded_step() -> None:
        out, loss = train()
        last.update(loss=loss, output_type=type(out).__name__, output_placements=repr(tuple(getattr(out, "placements", ()))))

    samples = []
    for i in range(warmup + steps):
        before_each()
        _sync(device)
        start = time.perf_counter()
        train()
        _sync(device)
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    before_each()
    for p in parameters:  # the profiled step starts, as every step does, without gradients
        p.grad = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
    with count_communication() as log:
        memory = profile_step_memory(
            recorded_step, lambda: [p.grad for p in parameters if p.grad is not None], device
        )
    loss = last.pop("loss")
    result: dict[str, Any] = {
        "step_s": statistics.median(samples),
        "step_samples_s": samples,
        "loss": float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss),
        **last,
        "params_bytes": _local_bytes(parameters),
        "grads_bytes": _local_bytes([p.grad for p in parameters if p.grad is not None]),
        "optimizer_state_bytes": _local_bytes(
            [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
        ),
        "bytes_sent": log.bytes_sent,
        "collectives": log.calls,
        **{f"{k}_bytes" if k != "allocations" else k: v for k, v in asdict(memory).items()},
    }
    if device.type == "cuda":
        result["cuda_allocator_peak_bytes"] = torch.cuda.max_memory_allocated(device) - allocated_before
    return result


def plain_reference(args: argparse.Namespace, threads: int, device: torch.device) -> dict[str, Any]:
    """The training step in this process on plain tensors (no ShardTensor, no process group)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(args.grid, args.state_channels, args.cond_channels, args.model, args.seed).to(device)
        inputs = {k: v.to(device) for k, v in global_batch(args.batch, args.state_channels, args.cond_channels, args.grid, args.seed).items()}
        result = measure_step(model, list(model.parameters()), inputs, device, warmup=args.warmup, steps=args.steps)
    finally:
        torch.set_num_threads(previous)
    return {"config": f"plain x{threads} thr" if device.type == "cpu" else "plain", "kind": "plain", "ranks": 1, "threads": threads, **result}


# ----- ranks -----------------------------------------------------------------------------------
FLOOR = "floor"  # the "data_parallel" of the concurrent plain processes (see _floor_body)


def _floor_body(args: argparse.Namespace, world: int, rank: int, group: Any) -> dict[str, Any]:
    """The plain model on this process's 1/world of the grid, all processes at once, no communication.

    What ``world`` processes on this machine can do at best: the same work as a sharded step
    (minus halos), run concurrently, so shared cores, memory bandwidth and caches are in it.  The
    model is the whole grid's (its configuration places attention by the grid's height), as each
    rank of the sharded step runs it.
    """
    rows = args.grid[0] // world
    grid = (rows, args.grid[1])
    model = build_model(args.grid, args.state_channels, args.cond_channels, args.model, args.seed)
    inputs = global_batch(args.batch, args.state_channels, args.cond_channels, grid, args.seed + rank)
    result = measure_step(model, list(model.parameters()), inputs, torch.device("cpu"), warmup=args.warmup,
                          steps=args.steps, before_each=lambda: barrier(group))
    return {"rank": rank, "local_grid": list(grid), **result}


def _rank_body(args: argparse.Namespace, data_parallel: str) -> dict[str, Any]:
    """One rank's measurement on a ("data", "domain") = (1, world) mesh; collective."""
    from physics_dp.distributed import DistributedManager
    from physics_dp.testing import sharded_code_on_size_one_axes

    if args.allocator == "keep":
        keep_freed_memory()
    manager = DistributedManager()
    if data_parallel == FLOOR:
        return _floor_body(args, manager.world_size, manager.rank, dist.group.WORLD)
    with sharded_code_on_size_one_axes() if args.sharded_code else contextlib.nullcontext():
        return _sharded_step_body(args, manager, data_parallel)


def _sharded_step_body(args: argparse.Namespace, manager: Any, data_parallel: str) -> dict[str, Any]:
    """The ShardTensor step on this rank: the model parallelized, the batch sharded on H."""
    from physics_dp.nn import domain_mesh, parallelize
    from physics_dp.shard_tensor import Shard, distribute_tensor

    mesh = manager.initialize_mesh((1, manager.world_size), ("data", "domain"))
    device = manager.device
    model = build_model(args.grid, args.state_channels, args.cond_channels, args.model, args.seed).to(device)
    parallel = parallelize(model, mesh, data_parallel)
    domain = domain_mesh(mesh)
    batch = global_batch(args.batch, args.state_channels, args.cond_channels, args.grid, args.seed)
    inputs = {k: distribute_tensor(v.to(device), domain, [Shard(2)]) for k, v in batch.items()}
    del batch
    group = domain.get_group(0)
    result = measure_step(
        parallel, list(parallel.model.parameters()), inputs, device,
        warmup=args.warmup, steps=args.steps, before_each=lambda: barrier(group),
    )
    if result["output_type"] != "ShardTensor":
        raise RuntimeError(f"the sharded model returned a {result['output_type']}, not a ShardTensor: the benchmark timed the wrong thing")
    return {"rank": manager.rank, "local_grid": list(inputs["state"].to_local().shape[-2:]), **result}


def sharded_run(args: argparse.Namespace, world: int, data_parallel: str) -> dict[str, Any]:
    """Spawn ``world`` ranks, measure, and merge: the slowest rank's time, the largest peaks."""
    per_rank = run_ranks(world, _rank_body, args, data_parallel)
    label = (f"{world} procs x1 thr, plain model on 1/{world} of the grid each, no communication (floor)"
             if data_parallel == FLOOR else f"{world} rank{'s' if world > 1 else ''} x1 thr ({data_parallel}"
             f"{', sharded code' if args.sharded_code and world == 1 else ''})")
    merged: dict[str, Any] = {"config": label, "kind": "floor" if data_parallel == FLOOR else "sharded",
                              "ranks": world, "threads": 1, "data_parallel": data_parallel, "per_rank": per_rank}
    for key in per_rank[0]:
        values = [r[key] for r in per_rank]
        if key == "loss":
            merged[key] = values[0]
        elif isinstance(values[0], (int, float)) and key != "rank":
            merged[key] = max(values)  # the slowest rank sets the pace; the fullest rank sets the memory
    merged.update(output_type=per_rank[0]["output_type"], output_placements=per_rank[0]["output_placements"])
    return merged


# ----- report ----------------------------------------------------------------------------------
def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add time ratios (against plain x1 thread and plain with as many threads as ranks), the
    activation-peak ratio to the 1-rank ShardTensor run (plain x1 if there is none) with its
    target, and the activation-peak ratio to the plain process."""
    plain = {r["threads"]: r for r in rows if r["kind"] == "plain"}
    one_thread = plain[min(plain)]
    baselines = {dp: r for r in rows if r["kind"] == "sharded" and r["ranks"] == 1 for dp in [r["data_parallel"]]}
    out = []
    for row in rows:
        same_threads = plain.get(row["ranks"], one_thread) if row["kind"] == "sharded" else row
        base = baselines.get(row.get("data_parallel"), one_thread)
        ratio = row["activation_peak_bytes"] / base["activation_peak_bytes"]
        to_plain = row["activation_peak_bytes"] / one_thread["activation_peak_bytes"]
        target = TARGET_SLACK / row["ranks"]
        out.append({
            **row,
            "speedup_vs_plain_1thread": one_thread["step_s"] / row["step_s"],
            "speedup_vs_plain_same_threads": same_threads["step_s"] / row["step_s"],
            "activation_ratio_to_1rank": ratio,
            "activation_ratio_to_plain": to_plain,
            "activation_target_ratio": target,
            "meets_activation_target": ratio <= target if row["kind"] == "sharded" else None,
        })
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One markdown table; memory in MiB per rank, times in ms, traffic in MiB sent per rank per step."""
    header = ("| config | step ms | speedup vs plain x1 | vs plain same threads | params MiB | grads MiB | AdamW state MiB "
              "| step peak MiB | activation peak MiB | act. ratio to 1 rank | target | act. ratio to plain | MiB sent/rank/step | collectives |")
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for r in rows:
        meets = {True: " ok", False: " MISSED", None: ""}[r["meets_activation_target"]]
        target = f"<= {r['activation_target_ratio']:.2f}{meets}" if r["kind"] == "sharded" else "-"
        lines.append(
            f"| {r['config']} | {r['step_s'] * 1e3:.0f} | {r['speedup_vs_plain_1thread']:.2f}x | {r['speedup_vs_plain_same_threads']:.2f}x "
            f"| {r['params_bytes'] / MIB:.2f} | {r['grads_bytes'] / MIB:.2f} | {r['optimizer_state_bytes'] / MIB:.2f} "
            f"| {r['step_peak_bytes'] / MIB:.1f} | {r['activation_peak_bytes'] / MIB:.1f} | {r['activation_ratio_to_1rank']:.3f} "
            f"| {target} | {r['activation_ratio_to_plain']:.3f} | {r['bytes_sent'] / MIB:.2f} | {r['collectives']} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", nargs=2, type=int, default=[256, 384], metavar=("H", "W"), help="global grid (default 256 384)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--state-channels", type=int, default=3)
    parser.add_argument("--cond-channels", type=int, default=5, help="background + invariant channels (default 5)")
    parser.add_argument("--model", default="lite", help="configs/model/<MODEL>.yaml whose regression block to use")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4], help="domain rank counts (default 1 2 4)")
    parser.add_argument("--data-parallel", nargs="+", default=["none"], choices=["none", "fsdp"])
    parser.add_argument("--floor", action="store_true",
                        help="add, per rank count N > 1, N concurrent plain processes on 1/N of the grid each: "
                        "the best an N-rank step can do on this machine")
    parser.add_argument("--allocator", choices=["keep", "default"], default="keep",
                        help="keep: every process keeps freed host memory, as the trainer does by default "
                        "(training.keep_freed_memory); default: glibc returns it and refaults it next step")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (>= 1: AdamW allocates its state)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded-code", action="store_true",
                        help="a 1-rank domain runs every op's sharded code instead of the plain op "
                        "(sharded_code_on_size_one_axes): what the multi-rank paths cost, on one GPU")
    parser.add_argument("--json", metavar="PATH", help="write every row (per-rank details included) here")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    notes = []
    ranks = sorted(set(args.ranks))
    if cuda and max(ranks) > torch.cuda.device_count():
        notes.append(f"skipped rank counts above the {torch.cuda.device_count()} GPU(s): "
                     f"{[n for n in ranks if n > torch.cuda.device_count()]}")
        ranks = [n for n in ranks if n <= torch.cuda.device_count()]
    cores = os.cpu_count() or 1
    if not cuda and max(ranks) > cores:
        notes.append(f"{max(ranks)} ranks on {cores} cores are oversubscribed: their times are not scaling numbers")
    if args.allocator == "keep":
        keep_freed_memory()
    rows = [plain_reference(args, threads, device) for threads in (sorted({1, *ranks}) if not cuda else [1])]
    rows += [sharded_run(args, world, dp) for dp in args.data_parallel for world in ranks]
    if args.floor:
        rows += [sharded_run(args, world, FLOOR) for world in ranks if world > 1]
    rows = summarize(rows)
    title = (f"StormCast regression U-Net ({args.model}) training step, global (N,C,H,W) = "
             f"({args.batch},{args.state_channels}+{args.cond_channels},{args.grid[0]},{args.grid[1]}), "
             f"torch {torch.__version__}, {'cuda/nccl' if cuda else f'cpu/gloo, {cores} cores'}, "
             f"median of {args.steps} steps after {args.warmup} warm-up, allocator {args.allocator}; "
             "memory per rank (largest rank)")
    text = "\n".join([title, "", format_table(rows), *[f"note: {n}" for n in notes]])
    print(text, flush=True)
    if args.json:
        payload = {"torch": torch.__version__, "device": str(device), "cores": cores, "notes": notes,
                   "settings": {k: v for k, v in vars(args).items() if k != "json"}, "target_slack": TARGET_SLACK, "rows": rows}
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
