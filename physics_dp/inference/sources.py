"""What the output file copies from the input files: variable attributes, the grid and the times.

Why read the files again: the dataset only keeps numbers, but a forecast is only usable when it
says what it holds (units, long names, cell methods) and where and when, in the source's own terms:
its coordinate names and attributes, 2-D latitude/longitude of curvilinear grids, bounds, the
level a variable was taken at (a scalar coordinate), and its time units and calendar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import cftime
import netCDF4
import numpy as np

from ..data import DataSpec
from ..data.catalog import Catalog
from ..data.cf_writer import Coordinate, HorizontalGrid
from ..data.files import open_dataset
from ..data.spec import open_catalogs
from ..data.times import to_date

__all__ = ["SourceInfo", "describe_sources"]

_LATITUDE = ("lat", "latitude", "nav_lat")
_LONGITUDE = ("lon", "longitude", "nav_lon")
# Attributes that describe how the source stored its numbers, not what they mean.
_STORAGE_ATTRS = {
    "_FillValue", "missing_value", "scale_factor", "add_offset", "valid_min", "valid_max", "valid_range",
    "actual_range", "coordinates", "_Unsigned", "chunksizes",
}


@dataclass
class SourceInfo:
    """Per-variable attributes, the state grid, and the times with their units and calendar."""

    variable_attrs: dict[str, dict[str, Any]]
    grid: HorizontalGrid
    seconds: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # since 1970 in `calendar`
    calendar: str = "standard"
    time_units: str = "hours since 1970-01-01 00:00:00"
    time_name: str = "time"  # the source's time dim

    @property
    def shape(self) -> tuple[int, int]:
        """(H, W) of the state grid."""
        return self.grid.shape

    @property
    def units(self) -> dict[str, str]:
        return {name: str(attrs.get("units", "unknown")) for name, attrs in self.variable_attrs.items()}

    def time(self, index: int) -> datetime | cftime.datetime:
        return to_date(self.seconds[index] / 3600.0, self.calendar)


def _attrs(var: netCDF4.Variable) -> dict[str, Any]:
    return {key: var.getncattr(key) for key in var.ncattrs() if key not in _STORAGE_ATTRS}


def _copy(var: netCDF4.Variable, into: dict[str, Coordinate], ds: netCDF4.Dataset) -> None:
    """``var`` as written in the source, and its bounds variable if it names one."""
    into.setdefault(var.name, Coordinate(var.name, var.dimensions, np.ma.getdata(var[...]), _attrs(var)))
    bounds = ds.variables.get(str(getattr(var, "bounds", "")))
    if bounds is not None:
        into.setdefault(bounds.name, Coordinate(bounds.name, bounds.dimensions, np.ma.getdata(bounds[...]), _attrs(bounds)))


def _is_geographic(name: str, var: netCDF4.Variable) -> bool:
    return name.lower() in _LATITUDE + _LONGITUDE or getattr(var, "standard_name", "") in ("latitude", "longitude")


def _horizontal(ds: netCDF4.Dataset, names: Sequence[str], dims: tuple[str, str], shape: tuple[int, int]) -> HorizontalGrid:
    """The coordinate variables of the (y, x) dims, the auxiliary coordinates on them (named by the
    fields' ``coordinates`` attribute, or 2-D latitude/longitude), their bounds and a grid mapping."""
    coordinates: dict[str, Coordinate] = {}
    auxiliary: list[str] = []
    for dim in dims:
        var = ds.variables.get(dim)
        if var is not None and var.dimensions == (dim,):
            _copy(var, coordinates, ds)
    listed = [c for name in names if name in ds.variables for c in str(getattr(ds.variables[name], "coordinates", "")).split()]
    for name, var in ds.variables.items():
        on_grid = bool(var.dimensions) and set(var.dimensions) <= set(dims) and var.dimensions != (name,)
        if on_grid and name not in names and (name in listed or _is_geographic(name, var)):
            _copy(var, coordinates, ds)
            auxiliary.append(name)
    for name in names:
        mapping = ds.variables.get(str(getattr(ds.variables.get(name), "grid_mapping", "")))
        if mapping is not None:
            _copy(mapping, coordinates, ds)
    return HorizontalGrid(dims, shape, tuple(coordinates.values()), tuple(auxiliary))


def _scalar_coordinates(
    ds: netCDF4.Dataset, var: netCDF4.Variable, keep: tuple[str, ...], level: int | None
) -> list[Coordinate]:
    """The level a field was taken at (its singleton or chosen index of each other dim) and the
    scalar coordinates it lists, as scalar coordinate variables."""
    found = []
    for dim, size in zip(var.dimensions, var.shape):
        coordinate = ds.variables.get(dim)
        if dim in keep or coordinate is None or coordinate.dimensions != (dim,):
            continue
        index = 0 if size == 1 else level
        attrs = {k: v for k, v in _attrs(coordinate).items() if k != "bounds"}  # the bounds of every level do not fit
        found.append(Coordinate(dim, (), np.ma.getdata(coordinate[index]), attrs))
    for name in str(getattr(var, "coordinates", "")).split():
        scalar = ds.variables.get(name)
        if scalar is not None and scalar.dimensions == ():
            found.append(Coordinate(name, (), np.ma.getdata(scalar[...]), _attrs(scalar)))
    return found


def _variables(
    state: Catalog, grid: HorizontalGrid, time_dim: str, level: int | None
) -> tuple[dict[str, dict[str, Any]], list[Coordinate]]:
    """Each state variable's attributes (from the first file holding it) and its scalar coordinates."""
    attrs: dict[str, dict[str, Any]] = {}
    scalars: dict[str, Coordinate] = {}
    for name in state.variables:
        with open_dataset(state.files_of(name)[0]) as ds:
            var = ds.variables[name]
            found = _scalar_coordinates(ds, var, (*grid.dims, time_dim), level)
            attrs[name] = _attrs(var)
            if found:
                attrs[name]["coordinates"] = " ".join(c.name for c in found)
            for coordinate in found:
                scalars.setdefault(coordinate.name, coordinate)
    return attrs, list(scalars.values())


def describe_sources(spec: DataSpec) -> SourceInfo:
    """Attributes of the state variables, the state grid and the state time axis."""
    catalogs = open_catalogs(spec)
    try:
        state = catalogs.state
        first = state.files_of(state.variables[0])[0]
        with open_dataset(first) as ds:
            grid = _horizontal(ds, state.variables, state.grid.dims, state.grid.shape)
        time_dim = state.time_coordinates[first].dim
        attrs, scalars = _variables(state, grid, time_dim, spec.level)
        grid = HorizontalGrid(grid.dims, grid.shape, grid.coordinates + tuple(scalars), grid.auxiliary)
        return SourceInfo(attrs, grid, state.seconds.copy(), state.calendar, state.time_units, time_dim)
    finally:
        catalogs.close()
