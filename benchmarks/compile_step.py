"""Compiled against eager: the StormCast regression U-Net training step, plain and on 1 and N domain ranks.

Why: ``training.compile`` should buy what compile buys plain PyTorch (fused pointwise kernels, no
Python dispatch per op), on sharded steps too.  One run prints, for plain torch (1 thread) and for
N = 1, 2 ranks x 1 thread, the median step time eager and compiled, compiled over eager, and the
compiled 1-rank step over the compiled plain step.  The first (warm-up) steps include the
compilation; its time is reported separately.

    python benchmarks/compile_step.py                          # 256x384 grid, ranks 1 2, inductor
    python benchmarks/compile_step.py --grid 128 192 --steps 3 --backend aot_eager

One step: ``zero_grad(set_to_none=True)``, forward, ``((out - target)**2).mean()``, backward,
AdamW step; the model is compiled in place (``physics_dp.nn.compile_in_place``) as the trainer
does.  Ranks are spawned here with one thread each on a ("data", "domain") = (1, N) mesh.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_memory import _sync, build_model, global_batch, training_step  # noqa: E402
from rank_processes import run_ranks  # noqa: E402

from physics_dp.distributed.collectives import barrier  # noqa: E402

__all__ = ["time_steps", "plain_row", "sharded_row", "main"]


def time_steps(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], device: torch.device, warmup: int, steps: int,
    before_each: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Warm-up seconds (compilation included) and the median of ``steps`` timed training steps."""
    train, _ = training_step(model, inputs)

    def step() -> float:
        before_each()
        _sync(device)
        start = time.perf_counter()
        train()
        _sync(device)
        return time.perf_counter() - start

    warm = sum(step() for _ in range(warmup))
    return {"warmup_s": warm, "step_s": statistics.median(step() for _ in range(steps))}


def _compiled(model: torch.nn.Module, backend: str | None) -> torch.nn.Module:
    from physics_dp.nn import compile_in_place

    return compile_in_place(model, backend) if backend else model


def plain_row(args: argparse.Namespace, backend: str | None, device: torch.device) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _compiled(build_model(args.grid, args.state_channels, args.cond_channels, args.model, args.seed).to(device), backend)
    inputs = {k: v.to(device) for k, v in global_batch(args.batch, args.state_channels, args.cond_channels, args.grid, args.seed).items()}
    return {"config": "plain x1 thr", "ranks": 0, "backend": backend or "eager", **time_steps(model, inputs, device, args.warmup, args.steps)}


def _rank_body(args: argparse.Namespace, backend: str | None) -> dict[str, Any]:
    from physics_dp.testing import sharded_code_on_size_one_axes

    with sharded_code_on_size_one_axes() if args.sharded_code else contextlib.nullcontext():
        return _sharded_steps(args, backend)


def _sharded_steps(args: argparse.Namespace, backend: str | None) -> dict[str, Any]:
    """This rank's eager or compiled ShardTensor steps, the batch sharded on H."""
    from physics_dp.distributed import DistributedManager
    from physics_dp.nn import domain_mesh, parallelize
    from physics_dp.shard_tensor import Shard, distribute_tensor

    manager = DistributedManager()
    mesh = manager.initialize_mesh((1, manager.world_size), ("data", "domain"))
    model = build_model(args.grid, args.state_channels, args.cond_channels, args.model, args.seed).to(manager.device)
    parallel = parallelize(model, mesh, "none")
    _compiled(parallel.model, backend)
    domain = domain_mesh(mesh)
    batch = global_batch(args.batch, args.state_channels, args.cond_channels, args.grid, args.seed)
    inputs = {k: distribute_tensor(v.to(manager.device), domain, [Shard(2)]) for k, v in batch.items()}
    group = domain.get_group(0)
    return time_steps(parallel, inputs, manager.device, args.warmup, args.steps, lambda: barrier(group))


def sharded_row(args: argparse.Namespace, world: int, backend: str | None) -> dict[str, Any]:
    """The slowest rank's times."""
    per_rank = run_ranks(world, _rank_body, args, backend)
    times = {key: max(r[key] for r in per_rank) for key in ("warmup_s", "step_s")}
    code = ", sharded code" if args.sharded_code and world == 1 else ""
    return {"config": f"{world} rank{'s' if world > 1 else ''} x1 thr{code}", "ranks": world, "backend": backend or "eager", **times}


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    eager = {r["config"]: r for r in rows if r["backend"] == "eager"}
    compiled_plain = next((r for r in rows if r["ranks"] == 0 and r["backend"] != "eager"), None)
    lines = ["| config | backend | step ms | compiled / eager | vs compiled plain | warm-up s (compile) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        versus_eager = r["step_s"] / eager[r["config"]]["step_s"] if r["backend"] != "eager" else 1.0
        versus_plain = (f"{r['step_s'] / compiled_plain['step_s']:.2f}x"
                        if compiled_plain is not None and r["backend"] != "eager" else "-")
        lines.append(f"| {r['config']} | {r['backend']} | {r['step_s'] * 1e3:.0f} | {versus_eager:.2f} | {versus_plain} "
                     f"| {r['warmup_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", nargs=2, type=int, default=[256, 384], metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--state-channels", type=int, default=3)
    parser.add_argument("--cond-channels", type=int, default=5)
    parser.add_argument("--model", default="lite")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded-code", action="store_true",
                        help="a 1-rank domain runs every op's sharded code (sharded_code_on_size_one_axes): on one GPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rows = [plain_row(args, None, device), plain_row(args, args.backend, device)]
    for world in sorted(set(args.ranks)):
        rows += [sharded_row(args, world, None), sharded_row(args, world, args.backend)]
    text = (f"StormCast regression U-Net ({args.model}) training step, grid {args.grid[0]}x{args.grid[1]}, "
            f"torch {torch.__version__}, {device.type}, median of {args.steps} steps after {args.warmup} warm-up\n\n"
            + format_table(rows))
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
