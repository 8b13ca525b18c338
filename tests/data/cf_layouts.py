"""Small files laid out like real CF archives that the team did not write, for the reader and round trips.

- ``write_climate``: a climate model's daily temperature on a 360-day calendar, split in time over
  two files (given as a list). The ``time`` dimension variable holds zeros without units; the real
  times are in the auxiliary coordinate ``time_value`` (standard_name time) that the fields name in
  their ``coordinates`` attribute. Regular grid on ``latitude``/``longitude`` with bounds; a second
  field (geopotential ``zg``) has a singleton pressure level ``plev``.
- ``write_ocean``: an ocean model's monthly means on a noleap calendar along ``time_counter`` (as
  NEMO names it), on a curvilinear grid: dims (j, i) without coordinate variables, 2-D ``latitude``/``longitude`` with vertex bounds, and sea
  surface temperature with a ``_FillValue`` land mask (the same land at every time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import cftime
import netCDF4
import numpy as np

HEIGHT, WIDTH = 12, 16
LAND = (slice(3, 7), slice(5, 11))  # rows, cols of the ocean files' land
FILL = np.float32(1.0e20)
NOLEAP_MONTH_STARTS = np.cumsum([0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31])


@dataclass(frozen=True)
class Layout:
    files: list[str]
    variables: list[str]
    calendar: str
    dates: list  # cftime dates of every time, in order


def _smooth(t: np.ndarray, kind: float) -> np.ndarray:
    """Fields that vary smoothly in time and space, so a tiny model has something to learn."""
    rows = np.linspace(0, np.pi, HEIGHT)[None, :, None]
    cols = np.linspace(0, 2 * np.pi, WIDTH)[None, None, :]
    t = np.asarray(t, dtype=np.float64)[:, None, None]
    return (kind + 5 * np.sin(rows + 0.3 * t) * np.cos(cols - 0.2 * t)).astype(np.float32)


def _set(var: netCDF4.Variable, values, **attrs) -> netCDF4.Variable:
    var.setncatts(attrs)
    var[...] = values
    return var


def _bounds_1d(centres: np.ndarray) -> np.ndarray:
    step = np.diff(centres).mean()
    return np.stack([centres - step / 2, centres + step / 2], axis=1)


def write_climate(root: str, n_times: int = 12) -> Layout:
    os.makedirs(root, exist_ok=True)
    days = 55.0 + np.arange(n_times)  # from 1850-02-26: Feb 29 and Feb 30 exist in this calendar
    lat = np.linspace(-55.0, 55.0, HEIGHT)
    lon = np.arange(WIDTH) * 22.5
    files = []
    half = n_times // 2
    for part, (start, stop) in enumerate(((0, half), (half, n_times))):
        path = os.path.join(root, f"tas_zg_{part}.nc")
        with netCDF4.Dataset(path, "w") as ds:
            ds.createDimension("time", None)
            ds.createDimension("latitude", HEIGHT)
            ds.createDimension("longitude", WIDTH)
            ds.createDimension("bnds", 2)
            ds.createDimension("plev", 1)
            _set(ds.createVariable("time", "f8", ("time",)), np.zeros(stop - start))  # no units, all zeros
            _set(
                ds.createVariable("time_value", "f8", ("time",)), days[start:stop],
                standard_name="time", units="days since 1850-01-01 00:00:00", calendar="360_day",
            )
            _set(
                ds.createVariable("latitude", "f8", ("latitude",)), lat,
                standard_name="latitude", units="degrees_north", axis="Y", bounds="latitude_bnds",
            )
            _set(ds.createVariable("latitude_bnds", "f8", ("latitude", "bnds")), _bounds_1d(lat))
            _set(
                ds.createVariable("longitude", "f8", ("longitude",)), lon,
                standard_name="longitude", units="degrees_east", axis="X", bounds="longitude_bnds",
            )
            _set(ds.createVariable("longitude_bnds", "f8", ("longitude", "bnds")), _bounds_1d(lon))
            _set(ds.createVariable("plev", "f8", ("plev",)), [50000.0], standard_name="air_pressure", units="Pa", axis="Z")
            t = np.arange(start, stop)
            _set(
                ds.createVariable("tas", "f4", ("time", "latitude", "longitude")), _smooth(t, 280.0),
                standard_name="air_temperature", units="K", long_name="Near-Surface Air Temperature",
                cell_methods="time: mean", coordinates="time_value",
            )
            _set(
                ds.createVariable("zg", "f4", ("time", "plev", "latitude", "longitude")), _smooth(t, 5500.0)[:, None],
                standard_name="geopotential_height", units="m", long_name="Geopotential Height", coordinates="time_value",
            )
        files.append(path)
    dates = list(cftime.num2date(days, "days since 1850-01-01", calendar="360_day"))
    return Layout(files=files[::-1], variables=["tas", "zg"], calendar="360_day", dates=dates)  # listed out of order


def ocean_land() -> np.ndarray:
    land = np.zeros((HEIGHT, WIDTH), dtype=bool)
    land[LAND] = True
    return land


def write_ocean(root: str, n_times: int = 12) -> Layout:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "sst_monthly.nc")
    days = (NOLEAP_MONTH_STARTS[:-1] + NOLEAP_MONTH_STARTS[1:]) / 2.0  # mid-month
    days = days[:n_times]
    j, i = np.meshgrid(np.arange(HEIGHT, dtype=np.float64), np.arange(WIDTH, dtype=np.float64), indexing="ij")
    lat = -40.0 + 6.0 * j + 0.5 * i  # a rotated, curvilinear grid
    lon = 100.0 + 5.0 * i - 0.8 * j
    vertices_lat = np.stack([lat - 3, lat - 3, lat + 3, lat + 3], axis=-1)
    vertices_lon = np.stack([lon - 2.5, lon + 2.5, lon + 2.5, lon - 2.5], axis=-1)
    sst = _smooth(np.arange(n_times), 290.0)
    sst[:, ocean_land()] = FILL
    with netCDF4.Dataset(path, "w") as ds:
        ds.createDimension("time_counter", None)
        ds.createDimension("j", HEIGHT)
        ds.createDimension("i", WIDTH)
        ds.createDimension("vertices", 4)
        _set(
            ds.createVariable("time_counter", "f8", ("time_counter",)), days,
            standard_name="time", units="days since 2000-01-01", calendar="noleap", axis="T",
        )
        _set(
            ds.createVariable("latitude", "f8", ("j", "i")), lat,
            standard_name="latitude", units="degrees_north", bounds="vertices_latitude",
        )
        _set(ds.createVariable("vertices_latitude", "f8", ("j", "i", "vertices")), vertices_lat, units="degrees_north")
        _set(
            ds.createVariable("longitude", "f8", ("j", "i")), lon,
            standard_name="longitude", units="degrees_east", bounds="vertices_longitude",
        )
        _set(ds.createVariable("vertices_longitude", "f8", ("j", "i", "vertices")), vertices_lon, units="degrees_east")
        _set(
            ds.createVariable("tos", "f4", ("time_counter", "j", "i"), fill_value=FILL), sst,
            standard_name="sea_surface_temperature", units="K", long_name="Sea Surface Temperature",
            coordinates="latitude longitude", cell_methods="area: mean where sea time: mean",
        )
    dates = list(cftime.num2date(days, "days since 2000-01-01", calendar="noleap"))
    return Layout(files=[path], variables=["tos"], calendar="noleap", dates=dates)
