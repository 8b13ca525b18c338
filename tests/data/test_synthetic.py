"""The synthetic dataset writer: CF layout, shapes, fill values, determinism, and safe (re)writing."""

from __future__ import annotations

import glob
import json
import os
import threading

import netCDF4
import numpy as np
import pytest

from physics_dp.data import write_synthetic_dataset
from physics_dp.data.synthetic import main


def _values(paths) -> dict[str, np.ndarray]:
    """Every variable of every file, concatenated along time where it has one."""
    out: dict[str, list[np.ndarray]] = {}
    for path in sorted(glob.glob(paths.state_glob)) + sorted(glob.glob(paths.background_glob)) + [paths.invariant_file]:
        with netCDF4.Dataset(path) as ds:
            for name, var in ds.variables.items():
                out.setdefault(f"{os.path.basename(path)[:5]}/{name}", []).append(np.ma.filled(var[:], np.nan))
    return {k: np.concatenate(v) if v[0].ndim > 2 else v[0] for k, v in out.items()}


def test_default_dataset_layout(tmp_path):
    paths = write_synthetic_dataset(tmp_path)
    assert paths.root == str(tmp_path)
    state_files = sorted(glob.glob(paths.state_glob))
    assert len(state_files) == 2 and len(glob.glob(paths.background_glob)) == 2
    assert paths.state_variables == ["u10m", "v10m", "t2m"]
    times = []
    for path in state_files:
        with netCDF4.Dataset(path) as ds:
            assert ds.Conventions.startswith("CF")
            assert ds["time"].units.startswith("hours since") and ds["time"].calendar == "standard"
            assert ds["u10m"].dimensions == ("time", "y", "x") and ds["u10m"].shape[1:] == (64, 96)
            assert ds["v10m"].dimensions == ("time", "level", "y", "x") and ds["v10m"].shape[1] == 1
            for name in paths.state_variables:
                assert ds[name].units and ds[name].long_name
            assert ds["y"].units == "km" and ds["x"].axis == "X"
            times.append(ds["time"][:])
    np.testing.assert_array_equal(np.concatenate(times), np.arange(48))
    with netCDF4.Dataset(sorted(glob.glob(paths.background_glob))[0]) as ds:
        assert ds["t2m"].shape[1:] == (17, 25)
        with netCDF4.Dataset(state_files[0]) as state:  # same area, coarser spacing
            assert ds["y"][-1] >= state["y"][-1] and ds["x"][-1] >= state["x"][-1]
            assert ds["y"][1] - ds["y"][0] == 4 * (state["y"][1] - state["y"][0])
    with netCDF4.Dataset(paths.invariant_file) as ds:
        assert set(paths.invariant_variables) <= set(ds.variables)
        assert ds["orography"].dimensions == ("y", "x") and ds["orography"].units == "m"


def test_missing_t2m_is_a_small_box_over_the_sea(synthetic):
    values = _values(synthetic)
    t2m = values["state/t2m"]
    missing = np.isnan(t2m)
    steps = np.flatnonzero(missing.any(axis=(1, 2)))
    assert steps.tolist() == [3, 9]
    assert 4 <= missing[3].sum() <= 0.05 * missing[3].size
    assert (values["invar/land_sea_mask"][missing[3]] < 0.5).all()
    with netCDF4.Dataset(sorted(glob.glob(synthetic.state_glob))[0]) as ds:
        assert ds["t2m"]._FillValue == np.float32(-9999.0)
    assert not np.isnan(values["state/u10m"]).any()
    assert 250 < np.nanmin(t2m) and np.nanmax(t2m) < 320


def test_fields_evolve_smoothly(synthetic):
    """Next states are close to current ones (a model can learn the step), and the background tracks the state."""
    values = _values(synthetic)
    t2m = values["state/t2m"]
    step_change = np.nanmean(np.abs(np.diff(t2m, axis=0)))
    spread = np.nanstd(t2m)
    assert 0 < step_change < 0.5 * spread
    coarse = values["backg/t2m"]
    assert abs(np.nanmean(coarse) - np.nanmean(t2m)) < 1.0


def test_same_seed_same_values_other_seed_other_values(tmp_path):
    kwargs = dict(n_times=5, height=12, width=16)
    a = _values(write_synthetic_dataset(tmp_path / "a", seed=3, **kwargs))
    b = _values(write_synthetic_dataset(tmp_path / "b", seed=3, **kwargs))
    c = _values(write_synthetic_dataset(tmp_path / "c", seed=4, **kwargs))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["state/t2m"], c["state/t2m"], equal_nan=True)


def test_complete_dataset_is_not_rewritten_and_other_parameters_are_refused(tmp_path):
    paths = write_synthetic_dataset(tmp_path, n_times=4, height=8, width=8)
    stamps = {p: os.stat(p).st_mtime_ns for p in glob.glob(str(tmp_path / "*.nc"))}
    again = write_synthetic_dataset(tmp_path, n_times=4, height=8, width=8)
    assert again == paths
    assert {p: os.stat(p).st_mtime_ns for p in glob.glob(str(tmp_path / "*.nc"))} == stamps
    with pytest.raises(ValueError, match="already holds a synthetic dataset written with .*use another out_dir"):
        write_synthetic_dataset(tmp_path, n_times=5, height=8, width=8)


def test_concurrent_writers_leave_one_complete_dataset(tmp_path):
    results, errors = [], []

    def write() -> None:
        try:
            results.append(write_synthetic_dataset(tmp_path, n_times=6, height=10, width=12))
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 3
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".synthetic.lock", "synthetic_complete.json", "invariants.nc"]
        + [f"{kind}_{k:03d}.nc" for kind in ("state", "background") for k in range(2)]
    )
    assert _values(results[0])["state/t2m"].shape == (6, 10, 12)


def test_bad_parameters_are_refused(tmp_path):
    with pytest.raises(ValueError, match="files_per_split=5 must be between 1 and n_times=4"):
        write_synthetic_dataset(tmp_path, n_times=4, files_per_split=5)
    with pytest.raises(ValueError, match="each must be at least 2"):
        write_synthetic_dataset(tmp_path, height=1)


def test_cli_writes_and_prints_the_paths(tmp_path, capsys):
    main(["--out", str(tmp_path), "--times", "4", "--height", "9", "--width", "10", "--seed", "1"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["state_variables"] == ["u10m", "v10m", "t2m"]
    with netCDF4.Dataset(printed["invariant_file"]) as ds:
        assert ds["orography"].shape == (9, 10)
