"""Every error of the reader names the problem and what to do."""

from __future__ import annotations

import numpy as np
import pytest

from physics_dp.data import DataSpec, WeatherDataset, compute_stats

from .ncfiles import write_nc

Y, X = np.arange(4.0), np.arange(5.0)


def grid_file(path, data: dict, times=range(3), y=Y, x=X, **kwargs) -> str:
    """A small file: each entry name -> dims or (dims, values); values default to ones of the right shape."""
    coords = {"time": np.asarray(times, dtype=np.float64)} if times is not None else {}
    coords.update({"y": y, "x": x})
    sizes = {"time": len(coords.get("time", [])), "y": len(y), "x": len(x), "level": 3, "height": 2, "one": 1}
    full = {}
    for name, spec in data.items():
        dims, values = spec if isinstance(spec, tuple) and isinstance(spec[0], tuple) else (spec, None)
        full[name] = (dims, np.ones([sizes[d] for d in dims], np.float32) if values is None else values)
    return write_nc(str(path), full, coords, **kwargs)


def spec_for(state, variables=("a",), **kwargs) -> DataSpec:
    return DataSpec(state_files=state, state_variables=list(variables), **kwargs)


@pytest.fixture
def simple(tmp_path) -> str:
    values = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
    return grid_file(tmp_path / "a.nc", {"a": (("time", "y", "x"), values), "b": ("time", "y", "x")})


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"state_files: no file matches the pattern .*nope_\*\.nc.*check the directory"):
        WeatherDataset(spec_for(str(tmp_path / "nope_*.nc")), normalize=False)
    with pytest.raises(FileNotFoundError, match="the file .*gone.nc' does not exist; check the path"):
        WeatherDataset(spec_for(str(tmp_path / "gone.nc")), normalize=False)
    with pytest.raises(ValueError, match="state_files: the file list is empty"):
        WeatherDataset(spec_for([]), normalize=False)


def test_unknown_variable_lists_the_available_ones(simple):
    with pytest.raises(ValueError, match=r"state variable 'c' not found in 1 file\(s\).*available variables: \['a', 'b'\]"):
        WeatherDataset(spec_for(simple, ["a", "c"]), normalize=False)


def test_files_without_time(tmp_path):
    no_time = grid_file(tmp_path / "n.nc", {"a": ("y", "x")}, times=None)
    with pytest.raises(ValueError, match="holds 'a' but has no time coordinate .*add one"):
        WeatherDataset(spec_for(no_time), normalize=False)
    mixed = grid_file(tmp_path / "m.nc", {"a": ("y", "x")})
    with pytest.raises(ValueError, match="has no time dim .*put time-independent fields in the invariant file"):
        WeatherDataset(spec_for(mixed), normalize=False)


def test_bad_dims(tmp_path):
    flat = grid_file(tmp_path / "f.nc", {"a": ("time",)})
    with pytest.raises(ValueError, match=r"has dims \('time',\); its last two dims must be the spatial"):
        WeatherDataset(spec_for(flat), normalize=False)
    two = grid_file(tmp_path / "t.nc", {"a": ("time", "level", "height", "y", "x")})
    with pytest.raises(ValueError, match=r"several non-singleton dims \['level', 'height'\]"):
        WeatherDataset(spec_for(two, level=0), normalize=False)


def test_level_needed_and_in_range(tmp_path):
    path = grid_file(tmp_path / "l.nc", {"a": ("time", "level", "y", "x"), "s": ("time", "one", "y", "x")})
    with pytest.raises(ValueError, match=r"dim 'level' of size 3; set DataSpec.level to pick one index \(0..2\)"):
        WeatherDataset(spec_for(path), normalize=False)
    with pytest.raises(ValueError, match=r"DataSpec.level=3 is out of range for dim 'level' \(size 3\).*use 0..2"):
        WeatherDataset(spec_for(path, level=3), normalize=False)
    assert WeatherDataset(spec_for(path, ["s"]), normalize=False)[0]["state"].shape == (1, 4, 5)  # singleton: no level needed


def test_grids_must_agree(tmp_path, simple):
    other = grid_file(tmp_path / "o.nc", {"c": ("time", "y", "x")}, y=np.arange(3.0))
    with pytest.raises(ValueError, match="state variables are on different grids: 'a' .* is 4x5 but 'c' .* is 3x5; regrid"):
        WeatherDataset(spec_for([simple, other], ["a", "c"]), normalize=False)
    shifted = grid_file(tmp_path / "s.nc", {"c": ("time", "y", "x")}, x=X + 0.5)
    with pytest.raises(ValueError, match=r"is 4x5 \(or has different coordinates\)"):
        WeatherDataset(spec_for([simple, shifted], ["a", "c"]), normalize=False)


def test_times_must_be_covered_once(tmp_path, simple):
    again = grid_file(tmp_path / "again.nc", {"a": ("time", "y", "x")}, times=[2, 3])
    with pytest.raises(ValueError, match="'a' appears twice at time index 2 .*remove the overlapping file"):
        WeatherDataset(spec_for([simple, again]), normalize=False)
    later = grid_file(tmp_path / "later.nc", {"c": ("time", "y", "x")}, times=[3, 4])
    with pytest.raises(ValueError, match="'a' has no data for 2 of 5 times .*add the files holding those times"):
        WeatherDataset(spec_for([simple, later], ["a", "c"]), normalize=False)


def test_nan_without_fill_value(tmp_path):
    values = np.ones((3, 4, 5), np.float32)
    values[2, 2, 3] = np.nan
    path = grid_file(tmp_path / "nan.nc", {"a": (("time", "y", "x"), values)})
    ds = WeatherDataset(spec_for(path), normalize=False)
    assert ds[0]["mask"].all()  # times 0 and 1 are clean
    with pytest.raises(ValueError, match="has NaN values at time index 2 .*but no _FillValue or missing_value .*set _FillValue=NaN"):
        ds[1]
    with pytest.raises(ValueError, match="has NaN values"):
        compute_stats(spec_for(path))
    marked = grid_file(tmp_path / "marked.nc", {"a": (("time", "y", "x"), values)}, attrs={"a": {"_FillValue": np.float32(np.nan)}})
    assert not WeatherDataset(spec_for(marked), normalize=False)[1]["mask"][0, 2, 3]


def test_all_missing_channel_has_no_stats(tmp_path):
    values = np.full((3, 4, 5), np.nan, np.float32)
    path = grid_file(tmp_path / "e.nc", {"a": (("time", "y", "x"), values)}, attrs={"a": {"_FillValue": np.float32(-1)}})
    with pytest.raises(ValueError, match=r"state variables \['a'\] have no valid \(non-missing\) value in the train split"):
        compute_stats(spec_for(path))


def test_spec_checks():
    with pytest.raises(ValueError, match="state_variables is empty"):
        DataSpec(state_files="x.nc", state_variables=[])
    with pytest.raises(ValueError, match="lead_time=0; it must be a positive"):
        DataSpec(state_files="x.nc", state_variables=["a"], lead_time=0)
    with pytest.raises(ValueError, match="background_variables is set but background_files is None"):
        DataSpec(state_files="x.nc", state_variables=["a"], background_variables=["b"])
    with pytest.raises(ValueError, match="invariant_variables is set but invariant_file is None"):
        DataSpec(state_files="x.nc", state_variables=["a"], invariant_variables=["b"])


def test_splits_and_windows(simple):
    with pytest.raises(ValueError, match=r"unknown split 'test'; use one of \('train', 'valid'\)"):
        WeatherDataset(spec_for(simple), "test", normalize=False)
    for times in [(0, 4), (2, 2), (-1, 2)]:
        with pytest.raises(ValueError, match=r"DataSpec.train_times=.* is empty or out of range for 3 time steps"):
            WeatherDataset(spec_for(simple, train_times=times), normalize=False)
    with pytest.raises(ValueError, match=r"valid_times=\(1, 3\) holds 2 time steps, too few for lead_time=2"):
        WeatherDataset(spec_for(simple, valid_times=(1, 3), lead_time=2), "valid", normalize=False)
    with pytest.raises(ValueError, match=r"rows=\(2, 5\) is out of range for a grid extent of 4"):
        WeatherDataset(spec_for(simple), rows=(2, 5), normalize=False)
    with pytest.raises(ValueError, match=r"cols=\(3, 3\) is out of range for a grid extent of 5"):
        WeatherDataset(spec_for(simple), cols=(3, 3), normalize=False)


def test_background_problems(tmp_path, simple):
    def background(name, **kwargs):
        return grid_file(tmp_path / name, {"g": ("time", "y", "x")}, **kwargs)

    cases = {
        "short.nc": (dict(times=[0, 1]), "the background files have no data at .* \\(state time index 2\\)"),
        "small.nc": (dict(y=np.array([0.0, 2.0])), "the state grid's 'y' spans \\[0, 3\\] but the background's spans \\[0, 2\\]"),
        "one.nc": (dict(x=np.array([0.0])), "background coordinate 'x' has 1 point\\(s\\); interpolation needs at least 2"),
        "zigzag.nc": (dict(y=np.array([0.0, 3.0, 1.0, 4.0])), "background coordinate 'y' is not strictly monotonic"),
    }
    for name, (kwargs, message) in cases.items():
        spec = spec_for(simple, background_files=background(name, **kwargs), background_variables=["g"])
        with pytest.raises(ValueError, match=message):
            WeatherDataset(spec, normalize=False)
    bare = write_nc(str(tmp_path / "bare.nc"), {"g": (("time", "y", "x"), np.ones((3, 2, 2), np.float32))}, {"time": np.arange(3.0)})
    with pytest.raises(ValueError, match="the background files have no coordinate variable for dim 'y'; add one"):
        WeatherDataset(spec_for(simple, background_files=bare, background_variables=["g"]), normalize=False)


def test_invariant_problems(tmp_path, simple):
    steps = grid_file(tmp_path / "steps.nc", {"z": ("time", "y", "x")})
    with pytest.raises(ValueError, match="invariant variable 'z' .* has 3 time steps; invariants must be time-independent"):
        WeatherDataset(spec_for(simple, invariant_file=steps, invariant_variables=["z"]), normalize=False)
    coarse = grid_file(tmp_path / "coarse.nc", {"z": ("y", "x")}, times=None, y=np.arange(2.0))
    with pytest.raises(ValueError, match="the invariants are on a 2x5 grid but the state is on 4x5; regrid"):
        WeatherDataset(spec_for(simple, invariant_file=coarse, invariant_variables=["z"]), normalize=False)
    twice = grid_file(tmp_path / "twice.nc", {"z": ("y", "x")}, times=None)
    copy = grid_file(tmp_path / "copy.nc", {"z": ("y", "x")}, times=None)
    spec = spec_for(simple, invariant_file=[twice, copy], invariant_variables=["z"])
    with pytest.raises(ValueError, match="invariant variable 'z' is in several files .*keep one copy"):
        WeatherDataset(spec, normalize=False)


def test_stats_must_match_the_channels(simple):
    stats = compute_stats(spec_for(simple, ["a"]))
    with pytest.raises(ValueError, match=r"the given stats have state channels \['a'\] but the dataset has \['a', 'b'\]"):
        WeatherDataset(spec_for(simple, ["a", "b"]), stats=stats)
