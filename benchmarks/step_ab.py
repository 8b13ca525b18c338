"""The StormCast lite training step on N domain ranks against plain torch on one thread, interleaved.

Why: ``model_memory.py`` times the plain step, then the sharded step, minutes apart.  On a shared
VM the plain 1-thread step alone moved between 4161 and 4856 ms from one run to the next, so the
speedup it reports moved with it (1.30x to 1.70x for the same code).  Here the two alternate
round by round in the same processes: rank 0 runs one plain step (global batch, 1 thread) while
the other ranks block in a gloo barrier (off the CPU), then every rank runs one sharded step.  A
burst of background load then hits both sides alike, and the median of the per-round ratios is
the speedup that load leaves least room to bend.

Each round ends with the step's floor: every rank at once runs the plain model (same weights,
same configuration) on its own slab of the batch, as a plain tensor.  That is the work a rank
would do with no overhead at all, beside the other ranks, as ``ops_scaling.py``'s "slab" is for
one op.  So the speedup splits into two readable factors, ``speedup = at most / overhead``:

- ``overhead`` = sharded / slab: what the framework costs (halos, statistics, waits, dispatch);
- ``at most`` = plain / slab: the speedup with no overhead, which the machine sets (how much
  slower a slab runs beside the other ranks than alone).

The floor undercounts one thing: a slab's attention attends to its own tokens only, a quarter of
the whole grid's work on 2 ranks, while the sharded step attends each rank's queries to every key
(half of it), as the whole grid must.

On GPUs each rank uses its device and the plain step runs on rank 0's (the times are then
synchronized with the device).  One step, as in ``model_memory.py``:
``zero_grad(set_to_none=True)``, forward, ``((out - target)**2).mean()``, backward, AdamW step;
the sharded model runs under ``parallelize(model, mesh, "none")`` on a ("data", "domain") =
(1, N) mesh with inputs ``distribute_tensor(..., [Shard(2)])``.  Both models start from the same
weights and data, so their first losses agree (printed, as the check that both sides compute the
same thing).

``--channels-last`` lays every side's batch out channels last, as ``training.channels_last``
does: the activations follow it, the parameters stay row-major (as FSDP2 needs; with the
parameters channels last too the step measured the same, 1.71x against 1.74x).

    python benchmarks/step_ab.py                      # 2 ranks, 256x384 grid, 7 rounds
    python benchmarks/step_ab.py --ranks 2 --grid 128 192 --rounds 5 --warmup 2
    python benchmarks/step_ab.py --channels-last
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_memory import _sync, build_model, global_batch, training_step  # noqa: E402
from rank_processes import run_ranks  # noqa: E402

__all__ = ["StepSides", "step_sides", "alternate_steps", "rounds_parser", "parse_rounds", "memory_format", "main"]


def _recording_losses(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """:func:`model_memory.training_step` of ``model`` on ``inputs``, and the list of losses it appends to."""
    train, _ = training_step(model, inputs)
    losses: list[torch.Tensor] = []
    return lambda: losses.append(train()[1]), losses


def _time_into(times: list[float], step: Callable[[], None], device: torch.device, timed: bool) -> None:
    """Run ``step`` (synchronized with ``device``) and append its seconds to ``times`` if ``timed``."""
    start = time.perf_counter()
    step()
    _sync(device)
    if timed:
        times.append(time.perf_counter() - start)


class StepSides(NamedTuple):
    """One training problem, set up for the scripts that time its sides against each other."""

    device: torch.device
    batch: dict[str, torch.Tensor]  # the global batch, whole on every rank
    sharded_model: torch.nn.Module  # ``parallelize(..., "none")``
    sharded_batch: dict[str, torch.Tensor]  # the batch sharded over H on the domain axis
    slab_model: torch.nn.Module  # the whole grid's model (its configuration places attention by the grid's height)
    slab_batch: dict[str, torch.Tensor]  # this rank's rows of the batch, as plain tensors: the floor


def step_sides(mesh: Any, grid: Sequence[int], memory_format: torch.memory_format = torch.contiguous_format) -> StepSides:
    """The sharded and the slab side of the StormCast lite step on ``mesh`` (a ("data", "domain")
    mesh with a data axis of size 1), on its device, from the same weights and data, batches in
    ``memory_format``."""
    from physics_dp.nn import domain_mesh, parallelize
    from physics_dp.shard_tensor import Shard, distribute_tensor

    domain = domain_mesh(mesh)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    batch = {k: v.to(device).contiguous(memory_format=memory_format) for k, v in global_batch(1, 3, 5, tuple(grid), 0).items()}
    sharded_batch = {k: distribute_tensor(v, domain, [Shard(2)]) for k, v in batch.items()}
    return StepSides(
        device, batch, parallelize(_model(grid, device), mesh, "none"), sharded_batch,
        _model(grid, device), {k: v.to_local().detach().clone() for k, v in sharded_batch.items()},
    )


def _model(grid: Sequence[int], device: torch.device) -> torch.nn.Module:
    return build_model(tuple(grid), 3, 5).to(device)


def alternate_steps(
    mesh: Any, grid: Sequence[int], rounds: int, warmup: int, memory_format: torch.memory_format = torch.contiguous_format
) -> dict[str, Any]:
    """Alternate a plain step (rank 0 only), a sharded step and a slab step (every rank at once),
    ``warmup + rounds`` times.

    ``mesh`` is a ("data", "domain") mesh with a data axis of size 1.  Returns this rank's timed
    seconds per round (``plain`` is empty except on rank 0) and the first step's losses.
    """
    from physics_dp.distributed.collectives import barrier
    from physics_dp.nn import domain_mesh

    domain = domain_mesh(mesh)
    sides = step_sides(mesh, grid, memory_format)
    device = sides.device
    sharded_step, sharded_losses = _recording_losses(sides.sharded_model, sides.sharded_batch)
    lead = dist.get_rank() == 0
    plain_step, plain_losses = _recording_losses(_model(grid, device), sides.batch) if lead else (None, [])
    slab_step, _ = _recording_losses(sides.slab_model, sides.slab_batch)
    plain, sharded, slab = [], [], []
    for index in range(warmup + rounds):
        timed = index >= warmup
        dist.barrier()  # gloo: the ranks not running the plain step wait off the CPU
        if plain_step is not None:
            _time_into(plain, plain_step, device, timed)
        dist.barrier()
        barrier(domain.get_group(0))
        _time_into(sharded, sharded_step, device, timed)
        barrier(domain.get_group(0))
        _time_into(slab, slab_step, device, timed)
    first = sharded_losses[0]
    return {"plain": plain, "sharded": sharded, "slab": slab, "plain_loss": float(plain_losses[0]) if plain_losses else None,
            "sharded_loss": float(first.full_tensor() if hasattr(first, "full_tensor") else first)}


def _rank_body(args: argparse.Namespace) -> dict[str, Any]:
    """One rank's part on a ("data", "domain") = (1, ranks) mesh, with freed memory kept as the trainer does."""
    from physics_dp.distributed import DistributedManager
    from physics_dp.distributed.host_memory import keep_freed_memory

    keep_freed_memory()
    mesh = DistributedManager().initialize_mesh((1, args.ranks), ("data", "domain"))
    return alternate_steps(mesh, args.grid, args.rounds, args.warmup, memory_format(args))


def summarize(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per round: the plain time, the slowest rank's sharded and slab times, and their ratios; the medians."""
    plain = per_rank[0]["plain"]
    sharded = [max(times) for times in zip(*(r["sharded"] for r in per_rank))]
    slab = [max(times) for times in zip(*(r["slab"] for r in per_rank))]
    ratios = [p / s for p, s in zip(plain, sharded)]
    overheads = [s / f for s, f in zip(sharded, slab)]
    at_most = [p / f for p, f in zip(plain, slab)]
    return {
        "plain_s": plain, "sharded_s": sharded, "slab_s": slab, "ratios": ratios, "overheads": overheads, "at_most": at_most,
        "median_plain_s": statistics.median(plain), "median_sharded_s": statistics.median(sharded),
        "median_slab_s": statistics.median(slab), "median_ratio": statistics.median(ratios),
        "median_overhead": statistics.median(overheads), "median_at_most": statistics.median(at_most),
        "plain_loss": per_rank[0]["plain_loss"], "sharded_loss": per_rank[0]["sharded_loss"],
    }


def format_report(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """One row per round, then the medians and the first losses (markdown, for docs/benchmarks.md)."""
    rows = "\n".join(
        f"| {i + 1} | {p * 1e3:.0f} | {s * 1e3:.0f} | {f * 1e3:.0f} | {r:.2f}x | {o:.2f} | {m:.2f}x |"
        for i, (p, s, f, r, o, m) in enumerate(zip(
            summary["plain_s"], summary["sharded_s"], summary["slab_s"], summary["ratios"], summary["overheads"], summary["at_most"]
        ))
    )
    return "\n".join([
        f"StormCast lite training step, grid {args.grid[0]}x{args.grid[1]}: plain x1 thread against {args.ranks} domain "
        f"ranks x1 thread, alternating, {args.rounds} rounds after {args.warmup} warm-up"
        f"{', channels last' if args.channels_last else ''}",
        "",
        "| round | plain x1 ms | sharded ms (slowest rank) | slab ms (slowest rank) | speedup | overhead (sharded / slab) "
        "| at most (plain / slab) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        rows,
        "",
        f"median: plain {summary['median_plain_s'] * 1e3:.0f} ms, sharded {summary['median_sharded_s'] * 1e3:.0f} ms, "
        f"slab {summary['median_slab_s'] * 1e3:.0f} ms; medians of the per-round ratios: speedup "
        f"{summary['median_ratio']:.2f}x, overhead {summary['median_overhead']:.2f}, at most {summary['median_at_most']:.2f}x",
        f"first-step loss: plain {summary['plain_loss']:.6f}, sharded {summary['sharded_loss']:.6f}",
    ])


def rounds_parser(description: str) -> argparse.ArgumentParser:
    """The options of a script that alternates steps in rounds on N ranks (this one, ``step_families.py``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--grid", nargs=2, type=int, default=[256, 384], metavar=("H", "W"))
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--channels-last", action="store_true", help="batches (so activations) channels last")
    return parser


def memory_format(args: argparse.Namespace) -> torch.memory_format:
    """The memory format ``--channels-last`` asks for."""
    return torch.channels_last if args.channels_last else torch.contiguous_format


def parse_rounds(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.rounds < 1 or args.warmup < 1:
        parser.error("--ranks must be >= 2, --rounds and --warmup >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    args = parse_rounds(rounds_parser(__doc__), argv)
    text = format_report(summarize(run_ranks(args.ranks, _rank_body, args)), args)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
