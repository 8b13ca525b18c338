"""benchmarks/ops_scaling.py measures what it says: every op family, the right slab, a full run.

Timings are never asserted; what is checked is that each case runs forward and backward, that
the slab baseline is the rank's rows plus exactly the halo rows, and that a run prints a row with
the bytes and collectives counted.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from ._scripts import BENCHMARKS, load_benchmark

# op modules of physics_dp/ops that a benchmark case exercises (by a word of its name)
FAMILIES = {
    "conv": "conv2d", "conv_transpose": "conv_transpose", "group_norm": "group_norm", "batch_norm": "batch_norm",
    "layer_norm": "layer_norm", "pooling": "pool", "interpolation": "interpolate", "pad": "pad", "fft": "fft",
    "attention": "attention", "reductions": "mean", "pointwise": "pointwise",
}


def test_every_op_family_has_a_case_that_runs_forward_and_backward() -> None:
    bench = load_benchmark("ops_scaling")
    names = [case.name for case in bench.CASES]
    for family, word in FAMILIES.items():
        assert any(word in name for name in names), f"no case for {family}"
    for case in bench.CASES:
        assert case.kind in bench.TARGETS
        assert "|" not in case.name, f"{case.name!r} would split its row of the markdown table"
        small = case.shape[:2] + tuple(8 for _ in case.shape[2:])
        for memory_format in (torch.contiguous_format, torch.channels_last):  # (--channels-last)
            gen = torch.Generator().manual_seed(0)
            fn = case.build(gen, small, memory_format)
            x = torch.randn(small).contiguous(memory_format=memory_format).requires_grad_(True)
            fn(x).sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape, case.name


def test_slab_baseline_is_the_ranks_rows_plus_the_halo() -> None:
    bench = load_benchmark("ops_scaling")
    case = next(c for c in bench.CASES if c.halo == (1, 1))
    x = torch.arange(10.0).view(1, 1, 10, 1)
    sizes = [4, 3, 3]
    rows = [bench._slab_with_halo(x, case, sizes, rank).flatten().tolist() for rank in range(3)]
    assert rows == [[0, 1, 2, 3, 4], [3, 4, 5, 6, 7], [6, 7, 8, 9]]  # rows 0-3, 4-6, 7-9, one halo row each side


def test_a_run_prints_one_row_per_op_with_traffic() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "ops_scaling.py"), "--ops", "mean of squares", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| mean of squares")]
    assert len(rows) == 1, result.stdout
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    # one all-reduce forward of the (4, 32) means (the backward of a mean needs none): 512 bytes
    assert cells[-1] == "1" and cells[-2] == "0.00", cells
