"""Hyperslab samples on the synthetic dataset equal the slice of the whole-grid sample, bit for bit,
and read from disk only the window (and, for the coarse background, the rows/cols its taps touch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from physics_dp.data import WeatherDataset
from physics_dp.data.regrid import interpolate, linear_taps

KEYS = ("state", "target", "mask", "background", "invariants")


@pytest.fixture(scope="module")
def whole(synthetic_spec):
    ds = WeatherDataset(synthetic_spec)
    yield ds
    ds.close()


@pytest.mark.parametrize(
    "rows, cols",
    [((0, 11), None), ((11, 21), None), ((7, 8), None), (None, (0, 15)), (None, (13, 30)), ((5, 16), (9, 22)), ((20, 21), (29, 30))],
)
def test_window_equals_slice_of_whole_grid(synthetic_spec, whole, rows, cols):
    part = WeatherDataset(synthetic_spec, rows=rows, cols=cols, stats=whole.stats)
    (r0, r1), (c0, c1) = part.rows, part.cols
    for i in (0, 3, len(part) - 1):  # i = 3 has missing t2m in the state (time 3)
        mine, full = part[i], whole[i]
        for key in KEYS:
            assert torch.equal(mine[key], full[key][:, r0:r1, c0:c1]), key
        assert torch.equal(mine["time_index"], full["time_index"])
    part.close()


def test_window_reads_only_its_rows_and_the_background_rows_it_needs(synthetic_spec, whole, synthetic):
    part = WeatherDataset(synthetic_spec, rows=(8, 13), stats=whole.stats)
    part.reset_read_counts()
    part[2]
    counts = part.read_counts()
    width = whole.grid_shape[1]
    for name in synthetic.state_variables:
        assert counts["state"].windows[name] == {((8, 13), (0, width))}
        assert counts["state"].elements[name] == 2 * 5 * width
    # 4 state rows per coarse row: state rows 8..12 are coarse rows 2..3, plus the upper tap of row 12
    for name in synthetic.background_variables:
        assert counts["background"].windows[name] == {((2, 5), (0, 9))}
    assert counts["background"].total_elements == 3 * 3 * 9
    assert "invariants" in counts and counts["invariants"].total_elements == 0  # read once, at construction
    part.close()


def test_interpolation_leaves_out_missing_source_points():
    source = np.array([0.0, 1.0, 2.0])
    rows = linear_taps(source, np.array([0.25, 0.5, 1.5]), "y")
    cols = linear_taps(source, np.array([1.0]), "x")
    values = np.array([[1.0, 10.0, 0.0], [3.0, 30.0, 0.0], [5.0, 50.0, 0.0]])
    valid = np.ones_like(values, dtype=bool)
    out, ok = interpolate(values, valid, rows, cols)
    np.testing.assert_allclose(out[:, 0], [15.0, 20.0, 40.0])
    valid[1, 1] = False  # the middle source row is missing at the column we sample
    out, ok = interpolate(values, valid, rows, cols)
    np.testing.assert_allclose(out[:, 0], [10.0, 10.0, 50.0])  # renormalized onto the remaining tap
    assert ok.all()
    valid[0, 1] = False
    out, ok = interpolate(values, valid, rows, cols)
    assert ok[:, 0].tolist() == [False, False, True] and out[0, 0] == 0.0


def test_descending_source_coordinates():
    taps = linear_taps(np.array([90.0, 0.0, -90.0]), np.array([90.0, 45.0, -60.0]), "lat")
    values = np.array([[9.0], [0.0], [-9.0]])
    out = taps.apply(values, 0)
    np.testing.assert_allclose(out[:, 0], [9.0, 4.5, -6.0])
