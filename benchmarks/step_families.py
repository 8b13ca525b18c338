"""Where the sharded step's extra time goes, by module family, timed inside the real step against its floor.

Why: ``torch.profiler`` (``step_profile.py``) slows what it records, and its self times of Python
Functions mix waiting with work: in one run at 256 x 384 the sharded step took 1388 ms profiled
against 1096 ms not, and its convolution backward calls, timed around them, 547 against 433 ms.
Here each family of modules is timed by the wall clock inside the step itself:

- an identity autograd Function before and after every module of a family marks where its
  forward starts and ends, and where its backward starts and ends;
- the same is done to the floor's model, which every rank runs on its own slab as a plain tensor
  at the same time (as ``step_ab.py``'s slab);
- the host channel's running total of seconds spent waiting for a late peer
  (:func:`physics_dp.distributed.host_channel.seconds_waited`) is read at the same marks, so each
  family's waiting shows apart from its work (the step's own: up to its last op, not the barrier
  after it, where a faster rank waits for the slowest).

Rounds alternate the sharded step and the slab step in the same processes; every figure is the
median over the rounds.  "Everything else" is the step (barrier to barrier) less the families:
pointwise ops, concatenations, resampling, embeddings, the loss, gradient reductions, the
optimizer step.  A module whose input needs no gradient (the first convolution, fed the data)
has its backward in "everything else": marking it would make autograd compute that gradient.

The floor of attention is the slab's times the number of domain ranks: exact attention on N
ranks attends each rank's 1/N of the queries to every key, N times the work of a slab attending
to its own tokens.  The step's floor is the slab step plus that difference.  The marks cost a few
microseconds each (two autograd nodes per module), on both sides.  CPU ranks only: on a GPU the
marks would time kernel launches, not kernels, so a CUDA mesh is refused.

    python benchmarks/step_families.py                     # 2 ranks, 256x384 grid, 7 rounds
    python benchmarks/step_families.py --grid 64 96 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_memory import training_step  # noqa: E402
from rank_processes import run_ranks  # noqa: E402
from step_ab import memory_format, parse_rounds, rounds_parser, step_sides  # noqa: E402

from physics_dp.distributed.host_channel import seconds_waited  # noqa: E402

__all__ = ["FAMILIES", "FamilyClock", "time_families", "summarize", "format_report", "main"]

# leaf modules only: a family's marks never nest inside another's
FAMILIES: dict[str, Callable[[nn.Module], bool]] = {
    "conv 3x3": lambda m: isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1),
    "conv 1x1": lambda m: isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1),
    "group norm": lambda m: isinstance(m, nn.GroupNorm),
    "attention": lambda m: isinstance(m, nn.MultiheadAttention),
}


class FamilyClock:
    """Seconds of forward, backward and waiting per family of one model's modules, since the last ``reset``."""

    def __init__(self, model: nn.Module) -> None:
        self.seconds: Counter[str] = Counter()  # keys "<family>/forward", "/backward", "/waited"
        self.calls: Counter[str] = Counter()
        self._open: dict[tuple[int, str], tuple[float, float]] = {}  # (module id, pass) -> (start, waited at start)
        self._marked: set[int] = set()  # modules in their forward whose input was marked
        for module in model.modules():
            family = next((name for name, belongs in FAMILIES.items() if belongs(module)), None)
            if family is not None:
                module.register_forward_pre_hook(self._entering(family))
                module.register_forward_hook(self._leaving(family))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self._open.clear()
        self._marked.clear()

    def open(self, key: tuple[int, str]) -> None:
        self._open[key] = (time.perf_counter(), seconds_waited())

    def close(self, key: tuple[int, str], family: str) -> None:
        """Add the time since ``open(key)`` to the family's clock (nothing if ``reset`` came between)."""
        if key not in self._open:
            return
        start, waited = self._open.pop(key)
        self.seconds[f"{family}/{key[1]}"] += time.perf_counter() - start
        self.seconds[f"{family}/waited"] += seconds_waited() - waited

    def _entering(self, family: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> tuple:
            self.calls[family] += 1
            self.open((id(module), "forward"))
            x = args[0]
            if not x.requires_grad:  # its backward stays unmarked (see the module docstring)
                return args
            self._marked.add(id(module))
            marked = _Mark.apply(x, self, family, id(module), False)
            return tuple(marked if a is x else a for a in args)  # q is k is v stays true for attention

        return hook

    def _leaving(self, family: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            self.close((id(module), "forward"), family)
            if id(module) not in self._marked:
                return output
            self._marked.discard(id(module))
            first = output[0] if isinstance(output, tuple) else output
            marked = _Mark.apply(first, self, family, id(module), True)
            return (marked, *output[1:]) if isinstance(output, tuple) else marked

        return hook


class _Mark(torch.autograd.Function):
    """The identity; its backward opens (after a module) or closes (before it) that module's backward clock."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: FamilyClock, family: str, module: int, after: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.clock, ctx.family, ctx.module, ctx.after = clock, family, module, after
        return torch.ops.aten.alias(x)  # (view_as recomputes the strides of size-1 dims: a one-sample channels-last slab would turn row-major)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        key = (ctx.module, "backward")
        if ctx.after:
            ctx.clock.open(key)
        else:
            ctx.clock.close(key, ctx.family)
        return grad, None, None, None, None


def time_families(
    mesh: Any, grid: Sequence[int], rounds: int, warmup: int, layout: torch.memory_format = torch.contiguous_format
) -> dict[str, Any]:
    """Alternate a sharded and a slab step ``warmup + rounds`` times (models and batches in ``layout``);
    this rank's per-round results.

    ``mesh`` is a ("data", "domain") mesh with a data axis of size 1.  Each round of each side is
    ``{"step": s, "waited": s, "seconds": {"<family>/<forward|backward|waited>": s}, "calls": {family: n}}``.
    """
    from physics_dp.distributed.collectives import barrier
    from physics_dp.nn import domain_mesh

    if mesh.device_type != "cpu":
        raise ValueError(f"step_families times CPU ranks only; on {mesh.device_type} the marks would time kernel launches")
    problem = step_sides(mesh, grid, layout)
    sides = {
        "sharded": (training_step(problem.sharded_model, problem.sharded_batch)[0], FamilyClock(problem.sharded_model)),
        "slab": (training_step(problem.slab_model, problem.slab_batch)[0], FamilyClock(problem.slab_model)),
    }
    group = domain_mesh(mesh).get_group(0)
    results: dict[str, list] = {side: [] for side in sides}
    for index in range(warmup + rounds):
        for side, (step, clock) in sides.items():
            clock.reset()
            barrier(group)
            start, waited = time.perf_counter(), seconds_waited()
            step()
            waited = seconds_waited() - waited  # (not the barrier's: a faster rank waits there for the slowest one)
            barrier(group)
            if index >= warmup:
                results[side].append({"step": time.perf_counter() - start, "waited": waited,
                                      "seconds": dict(clock.seconds), "calls": dict(clock.calls)})
    return {"ranks": dist.get_world_size(group), **results}


def _rank_body(args: argparse.Namespace) -> dict[str, Any]:
    from physics_dp.distributed import DistributedManager
    from physics_dp.distributed.host_memory import keep_freed_memory

    keep_freed_memory()
    mesh = DistributedManager().initialize_mesh((1, args.ranks), ("data", "domain"))
    return time_families(mesh, args.grid, args.rounds, args.warmup, memory_format(args))


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r["seconds"].get(key, 0.0) for r in rounds)


def summarize(per_rank: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: per family (and "everything else", and the step) the median ms of the sharded and slab
    sides, the floor, the extra over the floor and the sharded side's waiting."""
    summaries = []
    for result in per_rank:
        sharded, ranks = result["sharded"], result["ranks"]
        rows = []
        for family in FAMILIES:
            ms = {side: 1e3 * sum(_median(result[side], f"{family}/{p}") for p in ("forward", "backward")) for side in ("sharded", "slab")}
            floor = ms["slab"] * (ranks if family == "attention" else 1)
            rows.append({"family": family, "calls": sharded[0]["calls"].get(family, 0), "sharded_ms": ms["sharded"],
                         "slab_ms": ms["slab"], "floor_ms": floor, "extra_ms": ms["sharded"] - floor,
                         "waited_ms": 1e3 * _median(sharded, f"{family}/waited")})
        step = {side: 1e3 * statistics.median(r["step"] for r in result[side]) for side in ("sharded", "slab")}
        waited = 1e3 * statistics.median(r["waited"] for r in sharded)
        rest = {side: step[side] - sum(row[f"{side}_ms"] for row in rows) for side in ("sharded", "slab")}
        rows.append({"family": "everything else", "calls": None, "sharded_ms": rest["sharded"], "slab_ms": rest["slab"],
                     "floor_ms": rest["slab"], "extra_ms": rest["sharded"] - rest["slab"],
                     "waited_ms": waited - sum(row["waited_ms"] for row in rows)})
        floor = step["slab"] + sum(row["floor_ms"] - row["slab_ms"] for row in rows)
        rows.append({"family": "step", "calls": None, "sharded_ms": step["sharded"], "slab_ms": step["slab"],
                     "floor_ms": floor, "extra_ms": step["sharded"] - floor, "waited_ms": waited})
        summaries.append({"rows": rows, "overhead": step["sharded"] / floor})
    return summaries


def format_report(summaries: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    """Rank 0's table, then each rank's extra and waiting per family (markdown, for docs/benchmarks.md)."""
    lines = [
        f"StormCast lite training step, grid {args.grid[0]}x{args.grid[1]}, {args.ranks} domain ranks x1 thread, "
        f"median of {args.rounds} rounds after {args.warmup} warm-up{', channels last' if args.channels_last else ''}; rank 0, ms",
        "",
        "| family | calls | sharded | slab | floor | extra over floor | of it waiting | extra per call | extra, every rank |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, row in enumerate(summaries[0]["rows"]):
        every = " / ".join(f"{s['rows'][index]['extra_ms']:.0f}" for s in summaries)
        calls = "" if row["calls"] is None else str(row["calls"])
        # the extra is mostly a fixed host cost per call (docs/benchmarks.md, twenty-eighth pass)
        per_call = f"{row['extra_ms'] / row['calls']:.2f}" if row["calls"] else ""
        lines.append(f"| {row['family']} | {calls} | {row['sharded_ms']:.1f} | {row['slab_ms']:.1f} | {row['floor_ms']:.1f} "
                     f"| {row['extra_ms']:.1f} | {row['waited_ms']:.1f} | {per_call} | {every} |")
    overheads = " / ".join(f"{s['overhead']:.3f}" for s in summaries)
    lines += ["", f"step / floor (attention's floor counted in full), every rank: {overheads}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = rounds_parser(__doc__)
    parser.add_argument("--json", help="also write every rank's summary here")
    args = parse_rounds(parser, argv)
    summaries = summarize(run_ranks(args.ranks, _rank_body, args))
    text = format_report(summaries, args)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summaries, handle, indent=1)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
