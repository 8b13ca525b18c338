"""CF time discovery: the dimension coordinate when it has units, else the auxiliary time coordinate the
fields name; 360_day and noleap calendars through cftime; clear errors for times that cannot be read."""

from __future__ import annotations

import numpy as np
import pytest

from physics_dp.data import DataSpec, WeatherDataset
from physics_dp.data.spec import open_catalogs

from .cf_layouts import HEIGHT, WIDTH, ocean_land, write_climate, write_ocean
from .ncfiles import write_nc


def _spec(layout, **kwargs) -> DataSpec:
    return DataSpec(state_files=layout.files, state_variables=layout.variables, **kwargs)


def test_auxiliary_time_coordinate_on_a_360_day_calendar(tmp_path):
    climate = write_climate(str(tmp_path))
    catalogs = open_catalogs(_spec(climate))
    try:
        state = catalogs.state
        assert state.calendar == "360_day" and state.n_times == 12
        dates = [state.date(t) for t in range(state.n_times)]
        assert dates == climate.dates  # in time order, though the files were listed last part first
        assert [(d.month, d.day) for d in dates[3:6]] == [(2, 29), (2, 30), (3, 1)]  # days no datetime can hold
        assert np.all(np.diff(state.seconds) == 86400)
        assert state.time_coordinates[climate.files[0]].variable == "time_value"
        assert state.time_units == "days since 1850-01-01 00:00:00"
    finally:
        catalogs.close()
    # Samples cross the file boundary in time order; the singleton level is squeezed.
    dataset = WeatherDataset(_spec(climate, train_times=(4, 8)), normalize=False)
    sample = dataset[1]
    assert sample["state"].shape == (2, HEIGHT, WIDTH) and int(sample["time_index"]) == 5
    dataset.close()


def test_noleap_monthly_means_with_a_land_mask(tmp_path):
    ocean = write_ocean(str(tmp_path))
    dataset = WeatherDataset(_spec(ocean), normalize=False)
    assert dataset._catalogs.state.calendar == "noleap"
    assert [dataset._catalogs.state.date(t).month for t in range(12)] == list(range(1, 13))
    mask = dataset[3]["mask"][0].numpy()
    np.testing.assert_array_equal(mask, ~ocean_land())
    dataset.close()


def test_times_that_cannot_be_read_name_the_fix(tmp_path):
    grid = {"y": np.arange(3.0), "x": np.arange(4.0)}
    values = np.ones((2, 3, 4), np.float32)
    unitless = tmp_path / "unitless.nc"
    write_nc(str(unitless), {"a": (("time", "y", "x"), values)}, {"time": np.zeros(2), **grid}, time_units="")
    with pytest.raises(ValueError, match="'time' in .*unitless.nc has no units .*add units to 'time'"):
        WeatherDataset(DataSpec(state_files=str(unitless), state_variables=["a"]), normalize=False)
    climate, ocean = write_climate(str(tmp_path / "c")), write_ocean(str(tmp_path / "o"))
    mixed = DataSpec(state_files=[climate.files[0], ocean.files[0]], state_variables=["tas", "tos"])
    with pytest.raises(ValueError, match="state files use different calendars .*360_day.*noleap.*convert the files to one calendar"):
        WeatherDataset(mixed, normalize=False)
    background = DataSpec(
        state_files=climate.files, state_variables=["tas"], background_files=ocean.files, background_variables=["tos"]
    )
    with pytest.raises(ValueError, match="state and background files use different calendars"):
        WeatherDataset(background, normalize=False)
