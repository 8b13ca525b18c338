"""What the output file copies from the input files: variable attributes, the grid and the times.

Why read the files again: the dataset only keeps numbers, but a forecast is only usable when it
says what it holds (units, long names) and where and when (coordinates, valid times).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

import netCDF4
import numpy as np

from ..data import DataSpec
from ..data.files import resolve_paths
from ..data.spec import open_catalogs

__all__ = ["SourceInfo", "describe_sources"]

_LAT_NAMES = ("lat", "latitude")
_LON_NAMES = ("lon", "longitude")
_EPOCH = datetime(1970, 1, 1)


@dataclass
class SourceInfo:
    """Per-variable attributes, the state grid as ``ForecastWriter`` grid arguments, and the times."""

    units: dict[str, str]
    long_names: dict[str, str]
    standard_names: dict[str, str]
    shape: tuple[int, int]  # (H, W) of the state grid
    grid: dict[str, np.ndarray | str] = field(default_factory=dict)
    seconds: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # since 1970, per time index

    def time(self, index: int) -> datetime:
        return _EPOCH + timedelta(seconds=int(self.seconds[index]))


def _variable_attrs(paths: list[str], names: list[str]) -> tuple[dict[str, str], dict[str, str], dict[str, str], str]:
    """units, long_name and standard_name of each variable (first file holding it), and the first such file."""
    holder = ""
    units: dict[str, str] = {}
    long_names: dict[str, str] = {}
    standard_names: dict[str, str] = {}
    for path in paths:
        with netCDF4.Dataset(path) as ds:
            for name in names:
                if name in ds.variables and name not in units:
                    holder = holder or path
                    var = ds.variables[name]
                    units[name] = str(getattr(var, "units", "unknown"))
                    long_names[name] = str(getattr(var, "long_name", name))
                    if hasattr(var, "standard_name"):
                        standard_names[name] = str(var.standard_name)
        if len(units) == len(names):
            break
    return units, long_names, standard_names, holder


def _grid_arguments(path: str, dims: tuple[str, str], y: np.ndarray | None, x: np.ndarray | None, shape: tuple[int, int]) -> dict:
    """1-D lat/lon for a regular grid named so, else y/x (indices when the file has none) with any 2-D lat/lon."""
    with netCDF4.Dataset(path) as ds:
        if dims[0].lower() in _LAT_NAMES and dims[1].lower() in _LON_NAMES and y is not None and x is not None:
            return {"lat": y, "lon": x}
        units = {d: str(getattr(ds.variables[d], "units", "1")) if d in ds.variables else "1" for d in dims}
        grid: dict = {
            "y": y if y is not None else np.arange(shape[0], dtype=np.float64),
            "x": x if x is not None else np.arange(shape[1], dtype=np.float64),
            "xy_units": units[dims[1]],
        }
        for key, names in (("lat", _LAT_NAMES), ("lon", _LON_NAMES)):
            for name in names:
                var = ds.variables.get(name)
                if var is not None and var.dimensions == dims:
                    grid[key] = np.asarray(var[:], dtype=np.float64)
                    break
        if ("lat" in grid) != ("lon" in grid):
            grid.pop("lat", None)
            grid.pop("lon", None)
        return grid


def describe_sources(spec: DataSpec) -> SourceInfo:
    """Attributes of the state variables, the state grid and the state time axis."""
    catalogs = open_catalogs(spec)
    try:
        state = catalogs.state
        paths = resolve_paths(spec.state_files, "state_files")
        units, long_names, standard_names, holder = _variable_attrs(paths, list(spec.state_variables))
        grid = _grid_arguments(holder, state.grid.dims, state.grid.y, state.grid.x, state.grid.shape)
        return SourceInfo(units, long_names, standard_names, state.grid.shape, grid, state.seconds.copy())
    finally:
        catalogs.close()
