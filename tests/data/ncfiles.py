"""Small hand-written netCDF files for the data tests, with values known in closed form.

The "world" set is a 73 x 144 lat/lon grid (latitude descending, as in ERA5), spread over files
the way real archives are: "u" split in time over two files (listed out of time order and with
different time units), "v" in a third file with a fill value and missing points, "t" with a
3-level dim and "q" with a singleton level dim in a fourth, a coarse background whose fields are
linear in (lat, lon) so bilinear interpolation of them is exact, and an invariant file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import netCDF4
import numpy as np

N_LAT, N_LON, N_TIMES = 73, 144, 10
LAT = np.linspace(90.0, -90.0, N_LAT)
LON = np.arange(N_LON) * 2.5
BG_LAT = np.linspace(90.0, -90.0, 19)
BG_LON = np.arange(37) * 10.0
FILL = -1.0e20


def write_nc(
    path: str,
    data: dict[str, tuple[tuple[str, ...], np.ndarray]],
    coords: dict[str, np.ndarray],
    attrs: dict[str, dict] | None = None,
    time_units: str = "hours since 2020-01-01 00:00:00",
) -> str:
    """Write coordinate variables and float32 data variables; NaNs become fill values if one is set."""
    attrs = attrs or {}
    with netCDF4.Dataset(path, "w") as ds:
        for name, values in coords.items():
            ds.createDimension(name, len(values))
            coord = ds.createVariable(name, "f8", (name,))
            coord[:] = values
            if name == "time":
                coord.units = time_units
        for name, (dims, values) in data.items():
            for dim, size in zip(dims, values.shape):
                if dim not in ds.dimensions:
                    ds.createDimension(dim, size)
            extra = dict(attrs.get(name, {}))
            var = ds.createVariable(name, "f4", dims, fill_value=extra.pop("_FillValue", None))
            for key, value in extra.items():
                var.setncattr(key, value)
            masked = "_FillValue" in attrs.get(name, {}) or "missing_value" in extra
            var[:] = np.ma.masked_invalid(values) if masked else values
    return path


def field(kind: float, times: np.ndarray, n_lat: int = N_LAT, n_lon: int = N_LON) -> np.ndarray:
    """Values that identify (variable, time, row, col): kind*1000 + 10*t + row + col/256 (float32-exact)."""
    t = np.asarray(times, dtype=np.float64)[:, None, None]
    rows = np.arange(n_lat, dtype=np.float64)[None, :, None]
    cols = np.arange(n_lon, dtype=np.float64)[None, None, :]
    return (kind * 1000 + 10 * t + rows + cols / 256).astype(np.float32)


def linear_background(kind: float, times: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """A field linear in lat and lon, so bilinear interpolation reproduces it exactly."""
    t = np.asarray(times, dtype=np.float64)[:, None, None]
    return (kind + 0.1 * t + 0.02 * lat[None, :, None] - 0.01 * lon[None, None, :]).astype(np.float64)


def v_missing(times: np.ndarray) -> np.ndarray:
    """Where "v" is missing: a 3 x 4 box at odd times."""
    missing = np.zeros((len(times), N_LAT, N_LON), dtype=bool)
    missing[np.asarray(times) % 2 == 1, 30:33, 10:14] = True
    return missing


@dataclass(frozen=True)
class World:
    root: str
    state_files: list[str]
    background_file: str
    invariant_file: str


def write_world(root: str) -> World:
    os.makedirs(root, exist_ok=True)
    times = np.arange(N_TIMES)
    grid = {"lat": LAT, "lon": LON}
    late = times[6:]
    u_late = write_nc(
        os.path.join(root, "u_late.nc"),
        {"u": (("time", "lat", "lon"), field(1, late))},
        {"time": (late + 2) / 24.0, **grid},  # days since 2 h before: same instants, other units
        time_units="days since 2019-12-31 22:00:00",
    )
    u_early = write_nc(
        os.path.join(root, "u_early.nc"), {"u": (("time", "lat", "lon"), field(1, times[:6]))}, {"time": times[:6], **grid}
    )
    v = np.where(v_missing(times), np.nan, field(2, times))
    v_file = write_nc(
        os.path.join(root, "v.nc"), {"v": (("time", "lat", "lon"), v)}, {"time": times, **grid}, attrs={"v": {"_FillValue": FILL}}
    )
    levels = np.stack([field(3 + k, times) for k in range(3)], axis=1)
    tq_file = write_nc(
        os.path.join(root, "tq.nc"),
        {"t": (("time", "level", "lat", "lon"), levels), "q": (("time", "height", "lat", "lon"), field(6, times)[:, None])},
        {"time": times, **grid},
    )
    background_file = write_nc(
        os.path.join(root, "background.nc"),
        {
            "bu": (("time", "lat", "lon"), linear_background(1.0, times, BG_LAT, BG_LON)),
            "bt": (("time", "lat", "lon"), linear_background(-2.0, times, BG_LAT, BG_LON)),
        },
        {"time": times, "lat": BG_LAT, "lon": BG_LON},
    )
    invariant_file = write_nc(
        os.path.join(root, "invariants.nc"),
        {"z": (("lat", "lon"), field(7, [0])[0]), "lsm": (("time", "lat", "lon"), field(8, [0]))},
        {"time": np.zeros(1), **grid},
    )
    return World(root, [u_late, u_early, v_file, tq_file], background_file, invariant_file)
