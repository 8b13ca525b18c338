"""CF netCDF writer: netCDF4 and xarray open the files, decode times, and values (NaN included) round-trip."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import cftime
import netCDF4
import numpy as np
import pytest
import torch
import xarray as xr

from physics_dp.data.cf_writer import FILL_VALUE, Coordinate, ForecastWriter, HorizontalGrid, write_forecast_netcdf

START = datetime(2024, 1, 15, 6)
UNITS = {"t2m": "K", "u10": "m s-1"}


def _fields(*shape: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    pairs = (("t2m", 280), ("u10", 0))
    return {name: (offset + rng.standard_normal(shape)).astype(np.float32) for name, offset in pairs}


def test_deterministic_forecast_round_trips(tmp_path):
    data = _fields(3, 4, 5)
    data["t2m"][1, 2, 3] = np.nan
    times = [START + timedelta(hours=6 * i) for i in range(3)]
    path = write_forecast_netcdf(
        tmp_path / "out" / "forecast.nc",
        {"t2m": data["t2m"], "u10": torch.from_numpy(data["u10"])},
        times=times,
        y=np.arange(4) * 3000.0,
        x=np.arange(5) * 3000.0,
        units=UNITS,
        long_names={"t2m": "2 m temperature"},
        attrs={"institution": "test", "source": "unit test"},
    )
    assert path.exists() and not path.with_name("forecast.nc.partial").exists()

    with netCDF4.Dataset(path) as ds:
        assert ds.data_model == "NETCDF4"
        assert ds.Conventions == "CF-1.8" and ds.title and "physics_dp" in ds.history and ds.institution == "test"
        assert ds["time"].units == "hours since 2024-01-15 06:00:00" and ds["time"].calendar == "proleptic_gregorian"
        assert ds.dimensions["time"].isunlimited()
        np.testing.assert_array_equal(ds["time"][:], [0.0, 6.0, 12.0])
        assert ds["y"].axis == "Y" and ds["y"].standard_name == "projection_y_coordinate" and ds["x"].units == "m"
        t2m = ds["t2m"]
        assert t2m.dimensions == ("time", "y", "x")
        assert t2m.units == "K" and t2m.long_name == "2 m temperature" and ds["u10"].long_name == "u10"
        assert t2m._FillValue == FILL_VALUE
        assert t2m[1].mask[2, 3]  # the NaN became the fill value

    with xr.open_dataset(path) as ds:
        np.testing.assert_array_equal(ds["time"].values, np.array(times, dtype="datetime64[ns]"))
        assert ds["forecast_reference_time"].values == np.datetime64(START)
        np.testing.assert_array_equal(ds["t2m"].values, data["t2m"])  # NaN where it was
        np.testing.assert_array_equal(ds["u10"].values, data["u10"])
        np.testing.assert_array_equal(ds["x"].values, np.arange(5) * 3000.0)


def test_ensemble_on_lat_lon_with_hours(tmp_path):
    data = _fields(2, 3, 4, 6)
    lat, lon = np.linspace(-10, 10, 4), np.linspace(0, 50, 6)
    path = write_forecast_netcdf(
        tmp_path / "ensemble.nc",
        data,
        times=[24, 48],
        reference_time=START,
        lat=lat,
        lon=lon,
        units=UNITS,
        ensemble=True,
        standard_names={"t2m": "air_temperature"},
    )
    with xr.open_dataset(path) as ds:
        assert ds["t2m"].dims == ("time", "ensemble", "lat", "lon")
        assert ds["t2m"].attrs["standard_name"] == "air_temperature"
        assert ds["ensemble"].attrs["standard_name"] == "realization"
        np.testing.assert_array_equal(ds["ensemble"].values, [0, 1, 2])
        assert ds["lat"].attrs["units"] == "degrees_north" and ds["lon"].attrs["units"] == "degrees_east"
        expected_times = [START + timedelta(hours=h) for h in (24, 48)]
        np.testing.assert_array_equal(ds["time"].values, np.array(expected_times, dtype="datetime64[ns]"))
        for name in UNITS:
            np.testing.assert_array_equal(ds[name].values, data[name])


def test_writer_appends_step_by_step_with_2d_lat_lon(tmp_path):
    path = tmp_path / "rollout.nc"
    lat, lon = np.meshgrid(np.linspace(30, 40, 4), np.linspace(-100, -90, 5), indexing="ij")
    steps = [_fields(4, 5, seed=i) for i in range(4)]
    times = [
        START.replace(tzinfo=timezone.utc),
        np.datetime64("2024-01-15T07:00"),
        START + timedelta(hours=2),
        START.replace(tzinfo=timezone(timedelta(hours=1))) + timedelta(hours=4),  # 09:00 UTC
    ]
    grid = {"y": np.arange(4.0), "x": np.arange(5.0), "lat": lat, "lon": lon, "xy_units": "km"}
    with ForecastWriter(path, ["t2m", "u10"], reference_time=START, units=UNITS, **grid) as writer:
        for time, fields in zip(times, steps):
            writer.write(time, {name: torch.from_numpy(values) for name, values in fields.items()})
            assert not path.exists()
        assert writer.steps == 4
    with xr.open_dataset(path) as ds:
        assert ds["t2m"].dims == ("time", "y", "x")
        assert ds["t2m"].attrs.get("coordinates") is None  # decoded into coords
        assert {"lat", "lon", "forecast_reference_time"} <= set(ds["t2m"].coords)
        assert ds["y"].attrs["units"] == "km"
        np.testing.assert_array_equal(ds["lat"].values, lat)
        expected_times = [START + timedelta(hours=h) for h in (0, 1, 2, 3)]
        np.testing.assert_array_equal(ds["time"].values, np.array(expected_times, dtype="datetime64[ns]"))
        np.testing.assert_array_equal(ds["u10"].values, np.stack([s["u10"] for s in steps]))


def test_source_grid_and_a_360_day_calendar(tmp_path):
    """A grid given as the source's own variables is written as given; cftime dates in the source's
    units and calendar round-trip."""
    lat = np.linspace(-5.0, 5.0, 3)
    grid = HorizontalGrid(
        ("latitude", "j"),
        (3, 4),
        (
            Coordinate("latitude", ("latitude",), lat, {"units": "degrees_north", "bounds": "latitude_bnds"}),
            Coordinate("latitude_bnds", ("latitude", "nv"), np.stack([lat - 2.5, lat + 2.5], 1), {}),
            Coordinate("nav_lon", ("latitude", "j"), np.arange(12.0).reshape(3, 4), {"units": "degrees_east"}),
            Coordinate("height", (), np.array(2.0), {"units": "m", "positive": "up"}),
        ),
        auxiliary=("nav_lon",),
    )
    times = [cftime.Datetime360Day(2000, 2, day) for day in (29, 30)]
    path = write_forecast_netcdf(
        tmp_path / "f.nc", {"tas": np.zeros((2, 3, 4))}, times=times, units={"tas": "K"}, grid=grid, calendar="360_day",
        time_units="days since 2000-01-01", variable_attrs={"tas": {"cell_methods": "time: mean", "coordinates": "height"}},
    )
    with netCDF4.Dataset(path) as ds:
        np.testing.assert_array_equal(ds["time"][:], [58.0, 59.0])  # 30 days a month
        assert ds["tas"].dimensions == ("time", "latitude", "j") and ds["latitude_bnds"].dimensions == ("latitude", "nv")
        assert ds["tas"].coordinates == "forecast_reference_time nav_lon height" and ds["tas"].cell_methods == "time: mean"
    with xr.open_dataset(path) as ds:
        assert list(ds["time"].values) == times and ds["height"].attrs == {"units": "m", "positive": "up"}
    with pytest.raises(ValueError, match="either grid= or y/x/lat/lon"):
        ForecastWriter(tmp_path / "g.nc", ["tas"], reference_time=times[0], units={"tas": "K"}, grid=grid, y=lat)


def test_failure_leaves_no_file(tmp_path):
    path = tmp_path / "crashed.nc"
    with pytest.raises(RuntimeError, match="boom"):
        grid = {"y": np.arange(2.0), "x": np.arange(3.0)}
        with ForecastWriter(path, ["t2m"], reference_time=START, units=UNITS, **grid) as writer:
            writer.write(0, {"t2m": np.zeros((2, 3))})
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_mistakes(tmp_path):
    grid = {"y": np.arange(2.0), "x": np.arange(3.0)}
    with pytest.raises(ValueError, match=r"no units for \['u10'\]"):
        ForecastWriter(tmp_path / "a.nc", ["u10"], reference_time=START, units={}, **grid)
    with pytest.raises(ValueError, match="give the grid"):
        ForecastWriter(tmp_path / "a.nc", ["t2m"], reference_time=START, units=UNITS)
    with pytest.raises(ValueError, match="must be 2-D"):
        ForecastWriter(
            tmp_path / "a.nc", ["t2m"], reference_time=START, units=UNITS, lat=np.zeros(2), lon=np.zeros(3), **grid
        )
    assert list(tmp_path.iterdir()) == []
    writer = ForecastWriter(tmp_path / "b.nc", ["t2m"], reference_time=START, units=UNITS, ensemble_size=2, **grid)
    with writer:
        with pytest.raises(ValueError, match=r"expected \(2, 2, 3\)"):
            writer.write(0, {"t2m": np.zeros((2, 3))})
        with pytest.raises(ValueError, match="declares"):
            writer.write(0, {"t2m": np.zeros((2, 2, 3)), "u10": np.zeros((2, 2, 3))})
        writer.write(1.5, {"t2m": np.zeros((2, 2, 3))})
        with pytest.raises(ValueError, match="times must increase"):
            writer.write(START, {"t2m": np.zeros((2, 2, 3))})
        assert writer.steps == 1


def test_whole_forecast_checks(tmp_path):
    grid = {"y": np.arange(2.0), "x": np.arange(3.0), "units": UNITS}
    with pytest.raises(ValueError, match="pass reference_time"):
        write_forecast_netcdf(tmp_path / "a.nc", {"t2m": np.zeros((1, 2, 3))}, times=[0], **grid)
    with pytest.raises(ValueError, match="2 time steps but 1 times"):
        write_forecast_netcdf(tmp_path / "a.nc", {"t2m": np.zeros((2, 2, 3))}, times=[START], **grid)
    with pytest.raises(ValueError, match=r"\(T, E, H, W\)"):
        write_forecast_netcdf(tmp_path / "a.nc", {"t2m": np.zeros((1, 2, 3))}, times=[START], ensemble=True, **grid)
    assert list(tmp_path.iterdir()) == []
