"""What the synchronisations of a sharded training step cost: the step with some collectives left out.

Why: a profile shows the time ranks spend blocked in collectives, but not what the step would
take without them (a rank that never waits also never falls out of step with its peer).  This
runs the StormCast regression U-Net step on N gloo ranks x 1 thread four ways and prints the
median step time of each:

- ``all``: the real step;
- ``no-small-reduces``: normalization statistics stay local and every all-reduce under 64 KiB
  (the norms' backward sums, replicated operands' gradient sums, the loss) returns its input;
- ``no-p2p``: point-to-point exchanges (halos, the attention ring) receive zeros, sending nothing;
- ``neither``: both.

The three ablations compute WRONG numbers on purpose: they bound what fewer or cheaper
synchronisations could save, and nothing else.  Compare them with ``model_memory.py --floor``.

    python benchmarks/sync_ablation.py [--ranks 2] [--grid 256 384] [--steps 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_memory import build_model  # noqa: E402
from rank_processes import run_ranks  # noqa: E402

__all__ = ["ABLATIONS", "ablated", "time_steps", "main"]

ABLATIONS = ("all", "no-small-reduces", "no-p2p", "neither")
_SMALL_BYTES = 64 * 2**10


@contextlib.contextmanager
def ablated(name: str) -> Iterator[None]:
    """Inside, the collectives that ablation ``name`` leaves out return without communicating."""
    from physics_dp.distributed import collectives
    from physics_dp.ops import normalization

    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; expected one of {ABLATIONS}")
    saved = (normalization.merge_moments, collectives.all_reduce, collectives.start_exchange)
    real_all_reduce = collectives.all_reduce
    if name in ("no-small-reduces", "neither"):
        def merge_moments(count: int, mean: torch.Tensor, var: torch.Tensor, groups: Any) -> tuple[torch.Tensor, ...]:
            return torch.full((1,), float(count), dtype=torch.float64), mean.reshape(-1).double(), var.reshape(-1).double()

        normalization.merge_moments = merge_moments

        def all_reduce(tensor: torch.Tensor, reduce_op: str, group: Any) -> torch.Tensor:
            if tensor.numel() * tensor.element_size() < _SMALL_BYTES:
                return tensor.contiguous().clone()
            return real_all_reduce(tensor, reduce_op, group)

        collectives.all_reduce = all_reduce
    if name in ("no-p2p", "neither"):
        def start_exchange(sends, recv_shapes, group, *, dtype, device, anchor=None):  # noqa: ANN001, ANN202
            zeros = {peer: torch.zeros(tuple(shape), dtype=dtype, device=device) for peer, shape in recv_shapes.items()}
            return collectives.PendingExchange([], zeros)

        collectives.start_exchange = start_exchange
    try:
        yield
    finally:
        normalization.merge_moments, collectives.all_reduce, collectives.start_exchange = saved


def time_steps(mesh: Any, grid: Sequence[int], steps: int, ablation: str) -> tuple[float, int]:
    """(median step seconds, collectives per step) of this rank under ``ablation``, barrier-timed, on a 1-D ``mesh``."""
    from physics_dp.distributed.collectives import barrier, count_communication
    from physics_dp.shard_tensor import Shard, distribute_tensor

    height, width = grid
    model = build_model((height, width), 3, 5)
    gen = torch.Generator().manual_seed(0)
    state, condition, target = (
        distribute_tensor(torch.randn(1, c, height, width, generator=gen), mesh, [Shard(2)]) for c in (3, 5, 3)
    )

    def step() -> None:
        model.zero_grad(set_to_none=True)
        ((model(state, condition) - target) ** 2).mean().backward()

    with ablated(ablation):
        step()
        with count_communication() as log:
            step()
        times = []
        for _ in range(steps):
            barrier()
            start = time.perf_counter()
            step()
            barrier()
            times.append(time.perf_counter() - start)
    return statistics.median(times), log.calls


def _rank_body(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    """Every ablation in turn on this rank of a 1-D domain mesh: (name, median step seconds, collectives)."""
    from physics_dp.distributed import DistributedManager

    mesh = DistributedManager().initialize_mesh((args.ranks,), ("domain",))
    return [(name, *time_steps(mesh, args.grid, args.steps, name)) for name in ABLATIONS]


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--grid", nargs=2, type=int, default=[256, 384], metavar=("H", "W"))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    rows = run_ranks(args.ranks, _rank_body, args)[0]
    full = rows[0][1]
    lines = [f"StormCast lite step, {args.ranks} ranks x 1 thread, grid {args.grid[0]}x{args.grid[1]}, median of {args.steps}",
             "(ablations compute wrong numbers on purpose)", "",
             "| collectives left out | step ms | vs all | collectives / step |", "| --- | --- | --- | --- |"]
    for name, seconds, calls in rows:
        lines.append(f"| {name} | {seconds * 1e3:.0f} | {seconds / full:.2f}x | {calls} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
