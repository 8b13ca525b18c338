"""The sharded norms' local kernels on a GPU: torch's op, our rows kept whole, our rows cut into parts.

Why: torch's CUDA kernels for per-row statistics and batch-norm reductions give each row one block
of threads, so layer norm over a whole sample (one row) or group norm with few groups leaves most
of a GPU idle.  The sharded norms cut such rows into parts (``physics_dp.ops.moments.row_parts``);
this script shows what that buys and where the thresholds sit.  It times the autograd functions
behind the sharded norms over no process group (one GPU hosts one rank: the statistics are the
slab's own), forward + backward with a random cotangent, against torch's own op on the same
tensor.  The three variants alternate within each round, so a burst of load hits all of them.

    python benchmarks/norms_gpu.py                     # CUDA device 0, four shapes, 24 rounds
    python benchmarks/norms_gpu.py --shapes 1,128,512,768 --rounds 40

On a CPU it runs too (for its smoke test), where rows are never cut: both of our columns time the
same code.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from physics_dp.ops import moments, normalization

__all__ = ["KINDS", "measure", "main"]

KINDS = ("group8", "group32", "batch", "layer")
_GROUPS = {"group8": 8, "group32": 32}


def _ours(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n, c = x.shape[:2]
    if kind == "layer":
        return normalization._NormalizeGlobally.apply(x, tuple(range(1, x.ndim)), (), 1e-5)
    layout = normalization._StatLayout(_GROUPS[kind], True) if kind in _GROUPS else normalization._StatLayout(c, False)
    return normalization._ChannelNorm.apply(x.reshape(n, c, -1), weight, bias, layout, (), 1e-5)[0].view(x.shape)


def _torch(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if kind in _GROUPS:
        return F.group_norm(x, _GROUPS[kind], weight, bias)
    if kind == "batch":
        return F.batch_norm(x, None, None, weight, bias, training=True)
    return F.layer_norm(x, x.shape[1:])


def _whole_rows(rows: int, length: int, device: torch.device, batch: int = 1) -> int:
    return 1


def measure(kind: str, shape: Sequence[int], device: torch.device, rounds: int) -> dict[str, float]:
    """Median ms of forward + backward for torch, our rows whole and our rows in parts, and our
    largest difference from torch relative to its largest value."""
    generator = torch.Generator().manual_seed(0)
    x = (3 + torch.randn(tuple(shape), generator=generator)).to(device).requires_grad_()
    weight = torch.randn(shape[1], generator=generator).to(device).requires_grad_()
    bias = torch.randn(shape[1], generator=generator).to(device).requires_grad_()
    cotangent = torch.randn(tuple(shape), generator=generator).to(device)
    inputs = [x] if kind == "layer" else [x, weight, bias]

    def step(norm: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = norm(kind, x, weight, bias)
        return (out, *torch.autograd.grad(out, inputs, cotangent))

    cutting = moments.row_parts
    variants: dict[str, Callable[[], object]] = {
        "torch": lambda: step(_torch), "whole rows": lambda: step(_ours), "in parts": lambda: step(_ours),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(rounds):
            for name, run in variants.items():
                moments.row_parts = normalization.row_parts = _whole_rows if name == "whole rows" else cutting
                _sync(device)
                start = time.perf_counter()
                run()
                _sync(device)
                samples[name].append(time.perf_counter() - start)
    finally:
        moments.row_parts = normalization.row_parts = cutting
    warm = min(4, rounds - 1)
    result = {name: statistics.median(times[warm:]) * 1e3 for name, times in samples.items()}
    ours, theirs = step(_ours), step(_torch)
    result["max rel diff"] = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(ours, theirs))
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1,64,128,128", "1,64,256,256", "4,64,256,256", "1,128,512,768"],
                        help="N,C,H,W of each slab")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; forward + backward ms, medians of {args.rounds} interleaved rounds")
    print("| norm | shape | torch | whole rows | in parts | statistics rows cut | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for text in args.shapes:
        shape = tuple(int(v) for v in text.split(","))
        for kind in args.kinds:
            if shape[1] % _GROUPS.get(kind, 1):
                print(f"| {kind} | {shape} | skipped: {shape[1]} channels do not split into {_GROUPS[kind]} groups | | | | |")
                continue
            row = measure(kind, shape, device, args.rounds)
            rows, length = _statistic_rows(kind, shape)
            cut = moments.row_parts(rows, length, device)
            print(f"| {kind} | {shape} | {row['torch']:.3f} | {row['whole rows']:.3f} | {row['in parts']:.3f} | "
                  f"{f'{rows} into {cut} parts' if cut > 1 else 'no'} | {row['max rel diff']:.1e} |")


def _statistic_rows(kind: str, shape: Sequence[int]) -> tuple[int, int]:
    """(rows, values per row) of the statistics kernel for ``kind`` on ``shape``."""
    n, c, spatial = shape[0], shape[1], shape[2] * shape[3]
    if kind == "layer":
        return n, c * spatial
    if kind in _GROUPS:
        return n * _GROUPS[kind], c // _GROUPS[kind] * spatial
    return n * c, spatial


if __name__ == "__main__":
    main()
