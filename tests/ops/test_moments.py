"""The moments helpers: how rows are cut into parts for a GPU's per-row kernels, and the parts' exact merge."""

from __future__ import annotations

import pytest
import torch

from physics_dp.ops.moments import _MIN_PART, _parts_dividing, merge_equal_parts, row_parts


@pytest.mark.parametrize(
    ("rows", "length", "batch", "parts"),
    [
        (1, 128 * 512 * 768, 1, 512),  # layer norm over a whole sample: one row becomes 512 (4 per processor)
        (8, 16 * 512 * 768, 1, 64),  # group norm, 8 groups: 512 rows in all
        (32, 4 * 512 * 768, 1, 16),  # group norm, 32 groups: at most 17 parts, 16 divides the row
        (1, 1 << 20, 1, 1),  # rows of at most _LONG_ROW values stay whole
        (8, 8 * 256 * 256, 1, 1),
        (8, 8 * 256 * 256, 4, 64),  # ... unless a batch of such runs makes a row long
        (128, 1 << 22, 1, 1),  # as many rows as processors
        (0, 1 << 22, 1, 1),  # no rows
        (1, 1_000_003 * 2, 1, 2),  # parts must divide the row: the largest divisor under the bound
        (1, 1_000_003, 1, 1),  # a prime length stays whole
    ],
)
def test_parts_divide_long_rows_up_to_four_per_processor(rows: int, length: int, batch: int, parts: int) -> None:
    got = _parts_dividing(rows, length, batch, 128)
    assert got == parts
    assert length % got == 0 and (got == 1 or batch * length // got >= _MIN_PART)


def test_rows_stay_whole_on_the_cpu() -> None:
    assert row_parts(1, 1 << 24, torch.device("cpu")) == 1


def test_equal_parts_merge_to_the_rows_statistics() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = 1e3 + 5 * torch.randn(3, 6 * 500, generator=generator, dtype=torch.float64)
    rows[1] = 2.0  # a constant row: rstd stays inf
    var, mean = torch.var_mean(rows.view(3, 6, 500), -1, correction=0)
    merged_mean, merged_rstd = merge_equal_parts(mean, var.rsqrt())
    want_var, want_mean = torch.var_mean(rows, -1, correction=0)
    torch.testing.assert_close(merged_mean, want_mean, rtol=1e-14, atol=0)
    torch.testing.assert_close(merged_rstd, want_var.rsqrt(), rtol=1e-12, atol=0)
    assert merged_rstd[1] == float("inf")
