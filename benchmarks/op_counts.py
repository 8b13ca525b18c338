"""Aten ops each sharded op issues, forward and backward, against torch's own op on the slab.

Why: on a GPU every aten op that is not a view launches a kernel, and each launch costs host time
however small its tensors.  An eager sharded step there was bound by the host (3112 kernels per
StormCast lite step against plain torch's 1365, most of them the norms' small statistics ops;
``docs/benchmarks.md``, sixteenth pass).  Counts are deterministic, so a change to an op's host
path can be judged on a CPU machine, where differences of microseconds drown in noise.

    python benchmarks/op_counts.py              # 2 ranks
    python benchmarks/op_counts.py --ranks 3

Counted on rank 0 under a ``TorchDispatchMode``: every aten call that reaches the dispatcher,
apart from views and allocations (no kernel).  The convolution's and the norms' handlers compute
on plain slabs, so every op they issue is counted, their collectives' tensor ops on the host
channel included (on GPUs, one NCCL call each).  An op that ShardTensor dispatches below autograd
(``silu``, the reference row) counts once, as its slab's op.  ``plain`` is the same op on the
rank's slab as a plain tensor.  Both sides run twice first, so that cached plans and constants
are in place, as in a training loop; the backward counts include accumulating ``.grad``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_processes import run_ranks  # noqa: E402

SHAPE = (2, 32, 16, 24)  # global (N, C, H, W), split on H
_NO_KERNEL = {  # allocations: memory, no kernel
    torch.ops.aten._unsafe_view.default, torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
}


class _OpCounter(TorchDispatchMode):
    """Counts the aten calls made inside it: all of them, and those that launch a kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.calls += 1
        self.kernels += not (func.is_view or func in _NO_KERNEL)
        return func(*args, **(kwargs or {}))


def cases() -> dict[str, Callable[[], Callable[..., torch.Tensor]]]:
    """Name -> a builder of the op (a module, or a function of the input), as a U-Net step calls it."""
    channels = SHAPE[1]
    return {
        "conv2d 3x3, padding 1": lambda: nn.Conv2d(channels, channels, 3, padding=1),
        "group_norm, 8 groups": lambda: nn.GroupNorm(8, channels),
        "batch_norm, training": lambda: nn.BatchNorm2d(channels),
        "instance_norm, affine": lambda: nn.InstanceNorm2d(channels, affine=True),
        "layer_norm over (C, H, W)": lambda: lambda x: F.layer_norm(x, x.shape[1:]),
        "silu": lambda: nn.SiLU(),
    }


def _counted(op: Callable[..., torch.Tensor], x: torch.Tensor) -> tuple[int, int, int]:
    """(forward kernels, backward kernels, all aten calls) of ``op(x)`` and its backward from a
    cotangent of ones, after two uncounted runs."""
    for _ in range(2):
        out = op(x)
        out.backward(torch.ones_like(out))
    forward, backward = _OpCounter(), _OpCounter()
    with forward:
        out = op(x)
    grad = torch.ones_like(out)
    with backward:
        out.backward(grad)
    return forward.kernels, backward.kernels, forward.calls + backward.calls


def measure(mesh: Any) -> list[dict[str, Any]]:
    """Per case: kernels forward and backward, sharded and plain, and all aten calls of each."""
    from physics_dp.shard_tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(0)
    full = torch.randn(SHAPE, generator=generator)
    sharded = distribute_tensor(full, mesh, [Shard(2)]).detach().requires_grad_(True)
    slab = sharded.to_local().detach().clone().requires_grad_(True)
    rows = []
    for name, build in cases().items():
        torch.manual_seed(0)
        op = build()
        row = {"name": name}
        for side, x in (("sharded", sharded), ("plain", slab)):
            forward, backward, calls = _counted(op, x)
            row.update({f"{side}_forward": forward, f"{side}_backward": backward, f"{side}_calls": calls})
        rows.append(row)
    return rows


def _rank_body(ranks: int) -> list[dict[str, Any]]:
    from physics_dp.distributed import DistributedManager
    from physics_dp.ops import fused_cpu

    fused_cpu.set_enabled(False)  # CPU-only kernels: the counts stand for a GPU, which runs the stock path

    mesh = DistributedManager().initialize_mesh((ranks,), ("domain",))
    return measure(mesh)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| op | sharded forward | sharded backward | plain forward | plain backward | sharded / plain | all aten calls, sharded / plain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        sharded, plain = r["sharded_forward"] + r["sharded_backward"], r["plain_forward"] + r["plain_backward"]
        lines.append(
            f"| {r['name']} | {r['sharded_forward']} | {r['sharded_backward']} | {r['plain_forward']} | {r['plain_backward']} "
            f"| {sharded / plain:.1f} | {r['sharded_calls']} / {r['plain_calls']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks must be >= 2")
    rows = run_ranks(args.ranks, _rank_body, args.ranks)[0]
    text = (f"Kernels (aten ops that are not views or allocations) per op, rank 0 of {args.ranks}, global {SHAPE} "
            f"split on H, forward and backward from a cotangent of ones\n\n{format_table(rows)}")
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
