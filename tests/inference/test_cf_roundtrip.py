"""Files laid out like real CF archives, through training and inference: the forecast keeps the source's
missing points missing, its coordinate names, attributes, auxiliary coordinates and bounds, the level a
field was taken at, and its time units and calendar (checked with xarray)."""

from __future__ import annotations

from pathlib import Path

import cftime
import netCDF4
import numpy as np
import pytest
import xarray as xr

from physics_dp.config import compose_config
from physics_dp.testing import run_on_ranks
from tests.data.cf_layouts import Layout, ocean_land, write_climate, write_ocean

VALID_START = 8  # data.valid_times=[8,12]: the forecast starts at time index 8, valid at 9 and 10


def _train(run_dir: str, files: list[str], variables: list[str]) -> None:
    from physics_dp.training.run import train

    train(
        compose_config(
            [
                "+experiment=stormcast",
                "training.stage=regression",
                "data=netcdf",
                f"data.state_files=[{','.join(files)}]",  # a list of files on the command line
                f"data.state_variables=[{','.join(variables)}]",
                f"data.train_times=[0,{VALID_START}]",
                f"data.valid_times=[{VALID_START},12]",
                f"data.stats_file={run_dir}/stats.json",
                "logging.wandb_mode=disabled",
                "logging.figures=false",
                "schedule=constant",
                f"run.dir={run_dir}",
                "training.max_steps=2",
                "training.global_batch_size=2",
                "training.validation_batches=1",
            ]
        )
    )


def _infer(tokens: list[str]) -> str:
    from physics_dp.infer import infer
    from physics_dp.inference import parse_args

    return str(infer(*parse_args(tokens)).forecast)


def _forecast(tmp_path: Path, layout: Layout, figures: bool = False) -> str:
    """Train two regression steps on one rank, forecast two steps with the grid split over two ranks."""
    run_on_ranks(1, _train, str(tmp_path / "run"), layout.files, layout.variables, timeout=120.0)
    tokens = [f"run_dir={tmp_path / 'run'}", f"out={tmp_path / 'out'}", "steps=2", f"figures={str(figures).lower()}"]
    return run_on_ranks(2, _infer, tokens, timeout=120.0)[0]


def _assert_times(ds: xr.Dataset, layout: Layout, name: str, units: str) -> None:
    time = ds[name]
    assert time.encoding["calendar"] == layout.calendar and time.encoding["units"] == units
    assert list(time.values) == layout.dates[VALID_START + 1 : VALID_START + 3]
    assert all(isinstance(t, cftime.datetime) and t.calendar == layout.calendar for t in time.values)
    assert ds["forecast_reference_time"].values.item() == layout.dates[VALID_START]


@pytest.mark.timeout(300)
def test_climate_model_on_360_days_with_auxiliary_time_and_a_singleton_level(tmp_path):
    climate = write_climate(str(tmp_path / "data"))
    forecast = _forecast(tmp_path, climate)
    with xr.open_dataset(forecast) as ds, xr.open_dataset(climate.files[0], decode_times=False) as src:
        _assert_times(ds, climate, "time", "days since 1850-01-01 00:00:00")
        assert dict(ds["tas"].sizes) == {"time": 2, "latitude": 12, "longitude": 16}
        for name in ("latitude", "longitude", "latitude_bnds", "longitude_bnds"):
            np.testing.assert_array_equal(ds[name].values, src[name].values)
            assert ds[name].attrs == src[name].attrs, name
        assert ds["latitude"].attrs["bounds"] == "latitude_bnds"
        assert ds["zg"].coords["plev"].item() == 50000.0 and ds["plev"].attrs == {"standard_name": "air_pressure", "units": "Pa", "axis": "Z"}
        for name in ("tas", "zg"):
            for key in ("standard_name", "units", "long_name"):
                assert ds[name].attrs[key] == src[name].attrs[key], (name, key)
            assert np.isfinite(ds[name].values).all()
        assert ds["tas"].attrs["cell_methods"] == "time: mean"
    with netCDF4.Dataset(forecast) as raw:  # the level belongs to zg only (xarray shows scalar coordinates on all)
        assert raw["zg"].coordinates.split() == ["forecast_reference_time", "plev"]
        assert raw["tas"].coordinates.split() == ["forecast_reference_time"]


@pytest.mark.timeout(300)
def test_ocean_model_on_a_curvilinear_noleap_grid_keeps_land_missing(tmp_path):
    ocean = write_ocean(str(tmp_path / "data"))
    forecast = _forecast(tmp_path, ocean, figures=True)
    assert len(list((tmp_path / "out" / "figures").glob("step_*.png"))) == 2  # drawn with land missing
    land = ocean_land()
    with xr.open_dataset(forecast) as ds, xr.open_dataset(ocean.files[0], decode_times=False) as src:
        _assert_times(ds, ocean, "time_counter", "days since 2000-01-01")
        assert dict(ds["tos"].sizes) == {"time_counter": 2, "j": 12, "i": 16}
        assert set(ds["tos"].coords) >= {"latitude", "longitude", "time_counter"}
        for name in ("latitude", "longitude", "vertices_latitude", "vertices_longitude"):
            np.testing.assert_array_equal(ds[name].values, src[name].values)
            assert ds[name].attrs == src[name].attrs, name
        for step in range(2):
            np.testing.assert_array_equal(np.isnan(ds["tos"].values[step]), land)  # land missing, sea forecast
        assert ds["tos"].attrs["cell_methods"] == src["tos"].attrs["cell_methods"]
    with netCDF4.Dataset(forecast) as raw:
        assert "_FillValue" in raw["tos"].ncattrs() and raw["tos"][0].mask.sum() == land.sum()
