"""WeatherDataset on hand-written files: time concatenation, merging by variable, levels, fill values,
exact interpolation, and per-rank row windows of a 73 x 144 grid split over 2 and 3 ranks."""

from __future__ import annotations

import dataclasses

import netCDF4
import numpy as np
import pytest
import torch

from physics_dp.data import DataSpec, WeatherDataset

from .ncfiles import BG_LAT, BG_LON, LAT, LON, N_LAT, N_LON, N_TIMES, field, linear_background, v_missing, write_nc


def expected_state(t: int, level: int = 1) -> np.ndarray:
    """Raw (u, v, t[level], q) at time t from the closed forms the files were written with."""
    return np.stack([field(1, [t])[0], field(2, [t])[0], field(3 + level, [t])[0], field(6, [t])[0]]).astype(np.float64)


def expected_background(t: int) -> np.ndarray:
    """The linear background evaluated at the state grid's (lat, lon): exactly what bilinear interpolation gives."""
    return np.stack([linear_background(k, [t], LAT, LON)[0] for k in (1.0, -2.0)])


def test_raw_sample_concatenates_files_merges_variables_and_picks_the_level(world_spec):
    ds = WeatherDataset(world_spec, normalize=False)
    assert ds.grid_shape == (N_LAT, N_LON)
    assert len(ds) == N_TIMES - world_spec.lead_time
    assert ds.channel_names == {"state": ["u", "v", "t", "q"], "background": ["bu", "bt"], "invariants": ["z", "lsm"]}
    for i in (0, 4, 5, len(ds) - 1):  # 4 -> 6 and 5 -> 7 cross from u_early.nc to u_late.nc
        sample = ds[i]
        lead = i + world_spec.lead_time
        valid = ~v_missing(np.arange(N_TIMES))[lead]
        assert int(sample["time_index"]) == i
        np.testing.assert_array_equal(sample["state"][0].numpy(), expected_state(i)[0].astype(np.float32))
        target = expected_state(lead)
        target[1][~valid] = 0.0
        np.testing.assert_array_equal(sample["target"].numpy(), target.astype(np.float32))
        np.testing.assert_array_equal(sample["mask"][1].numpy(), valid)
        assert sample["mask"][[0, 2, 3]].all()
        np.testing.assert_allclose(sample["background"].numpy(), expected_background(lead), rtol=0, atol=2e-5)
        np.testing.assert_array_equal(sample["invariants"].numpy(), np.stack([field(7, [0])[0], field(8, [0])[0]]))
    ds.close()


@pytest.mark.parametrize("level", [0, 2])
def test_level_selects_the_index_of_the_level_dim(world_spec, level):
    ds = WeatherDataset(dataclasses.replace(world_spec, level=level), normalize=False)
    np.testing.assert_array_equal(ds[3]["state"][2].numpy(), field(3 + level, [3])[0])
    ds.close()


def test_missing_points_are_zero_after_normalization_and_masked(world_spec):
    ds = WeatherDataset(world_spec, normalize=True)
    sample = ds[1]  # target time 3 is odd: "v" has its missing box
    assert not sample["mask"][1, 30:33, 10:14].any()
    assert sample["mask"].sum() == sample["mask"].numel() - 12
    assert (sample["target"][1, 30:33, 10:14] == 0).all()
    group = ds.stats.groups["state"]
    raw = expected_state(3)
    expected = (raw - group.mean[:, None, None]) / group.std[:, None, None]
    valid = sample["mask"].numpy()
    np.testing.assert_allclose(sample["target"].numpy()[valid], expected[valid].astype(np.float32), rtol=1e-6, atol=1e-6)
    ds.close()


def test_splits_cover_their_time_ranges(world_spec):
    spec = dataclasses.replace(world_spec, train_times=(0, 7), valid_times=(7, 10))
    train = WeatherDataset(spec, "train", normalize=False)
    valid = WeatherDataset(spec, "valid", normalize=False)
    assert [int(train[i]["time_index"]) for i in range(len(train))] == list(range(5))
    assert [int(valid[i]["time_index"]) for i in range(len(valid))] == [7]
    np.testing.assert_array_equal(valid[0]["target"][0].numpy(), field(1, [9])[0])
    with pytest.raises(IndexError, match="out of range"):
        valid[1]
    train.close()
    valid.close()


@pytest.mark.parametrize("ranks", [2, 3])
def test_row_windows_of_an_uneven_split_reassemble_the_grid_and_read_only_their_rows(world_spec, ranks):
    sizes = [len(part) for part in torch.tensor_split(torch.arange(N_LAT), ranks)]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    full = WeatherDataset(world_spec)
    parts = []
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        ds = WeatherDataset(world_spec, rows=(int(r0), int(r1)), stats=full.stats)
        ds.reset_read_counts()  # construction read the invariants once
        parts.append(ds[2])
        counts = ds.read_counts()
        for name in ["u", "v", "t", "q"]:
            assert counts["state"].windows[name] == {((r0, r1), (0, N_LON))}
            assert counts["state"].elements[name] == 2 * (r1 - r0) * N_LON  # state and target
        # background: only the coarse rows whose taps the window touches (10 degrees per coarse row)
        lat = LAT[r0:r1]
        need = np.flatnonzero((BG_LAT >= lat.min() - 10) & (BG_LAT <= lat.max() + 10))
        ((b0, b1), (c0, c1)), = counts["background"].windows["bu"]
        assert need[0] <= b0 and b1 <= need[-1] + 1 and (c0, c1) == (0, len(BG_LON))
        assert counts["background"].elements["bu"] == (b1 - b0) * len(BG_LON)
        ds.close()
    whole = full[2]
    for key in ("state", "target", "mask", "background", "invariants"):
        assert torch.equal(torch.cat([p[key] for p in parts], dim=1), whole[key]), key
    full.close()


def test_missing_value_attribute_marks_points_missing(tmp_path):
    values = np.ones((3, 4, 5), np.float32)
    values[1, 0, :2] = -999.0
    path = write_nc(
        str(tmp_path / "mv.nc"),
        {"a": (("time", "y", "x"), values)},
        {"time": np.arange(3.0), "y": np.arange(4.0), "x": np.arange(5.0)},
    )
    with netCDF4.Dataset(path, "a") as ds:
        ds["a"].missing_value = np.float32(-999.0)
    ds = WeatherDataset(DataSpec(state_files=path, state_variables=["a"]), normalize=False)
    assert ds[0]["mask"].sum() == 20 - 2 and not ds[0]["mask"][0, 0, :2].any()
    assert (ds[0]["target"][0, 0, :2] == 0).all() and ds[1]["state"][0].sum() == 18
    ds.close()
