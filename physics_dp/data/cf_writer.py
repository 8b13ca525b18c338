"""CF-1.8 netCDF output for forecasts and ensembles, written one time step at a time.

Why step by step: a long rollout (or a large ensemble) does not fit in memory, so
``ForecastWriter`` appends each step along an unlimited time dimension. Why a temporary name:
the file appears under its final name only once complete, so a crashed run never leaves a
truncated file that looks finished (the partial file is removed).

The layout follows CF-1.8: coordinate variables for every dimension, a ``time`` in
"hours since <reference>" with a calendar, a scalar ``forecast_reference_time``, an optional
``ensemble`` dimension (standard name ``realization``), per-variable ``units``/``long_name``/``_FillValue``, and
the global ``Conventions``/``title``/``history`` attributes. NaNs are stored as the fill value,
so CF readers (xarray) decode them back to NaN.

A forecast of existing files should look like them: ``HorizontalGrid`` carries the source's own
coordinate variables (names, attributes, 2-D latitude/longitude of curvilinear grids, bounds,
scalar coordinates such as a singleton level), written as given instead of the y/x or lat/lon the
writer would make up; times may be in the source's units and calendar (cftime dates for
non-standard calendars).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import cftime
import netCDF4
import numpy as np
import torch

from physics_dp.shard_tensor import ShardTensor

from .files import NETCDF_LOCK

ArrayLike = np.ndarray | torch.Tensor
DateLike = datetime | np.datetime64 | cftime.datetime
TimeLike = DateLike | float | int

CONVENTIONS = "CF-1.8"
FILL_VALUE = np.float32(netCDF4.default_fillvals["f4"])


@dataclass(frozen=True)
class Coordinate:
    """One coordinate-like variable: its name, dimensions, values and attributes (dims () for a scalar)."""

    name: str
    dims: tuple[str, ...]
    values: np.ndarray
    attrs: dict[str, Any]


@dataclass(frozen=True)
class HorizontalGrid:
    """The horizontal dims (y, x) with their sizes, and the variables that describe them.

    ``coordinates`` are written as given (coordinate variables, 2-D auxiliary coordinates, bounds,
    scalar coordinates, a grid mapping); ``auxiliary`` names those that every field lists in its
    ``coordinates`` attribute.
    """

    dims: tuple[str, str]
    shape: tuple[int, int]
    coordinates: tuple[Coordinate, ...] = ()
    auxiliary: tuple[str, ...] = ()


def _to_numpy(array: ArrayLike, name: str) -> np.ndarray:
    if isinstance(array, ShardTensor):
        raise TypeError(f"{name} is a ShardTensor: call .full_tensor() on every rank first, then write from one rank")
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    return np.asarray(array)


def _as_datetime(time: DateLike) -> datetime | cftime.datetime:
    """A naive UTC datetime (netCDF time units carry no zone); cftime dates pass as they are."""
    if isinstance(time, cftime.datetime):
        return time
    if isinstance(time, np.datetime64):
        time = time.astype("datetime64[us]").item()
    if time.tzinfo is not None:
        time = time.astimezone(timezone.utc).replace(tzinfo=None)
    return time


def _grid(
    y: ArrayLike | None, x: ArrayLike | None, lat: ArrayLike | None, lon: ArrayLike | None, xy_units: str
) -> HorizontalGrid:
    """The grid made from 1-D y/x (projected, optional 2-D lat/lon) or 1-D lat/lon."""
    geographic = {
        "lat": {"standard_name": "latitude", "long_name": "latitude", "units": "degrees_north"},
        "lon": {"standard_name": "longitude", "long_name": "longitude", "units": "degrees_east"},
    }
    if y is None and x is None:
        if lat is None or lon is None:
            raise ValueError("give the grid: 1-D y and x (projected), or 1-D lat and lon (regular lat-lon)")
        lat, lon = _to_numpy(lat, "lat").astype(np.float64), _to_numpy(lon, "lon").astype(np.float64)
        if lat.ndim != 1 or lon.ndim != 1:
            raise ValueError("without y and x, lat and lon must be 1-D (a regular grid); pass y/x for a 2-D lat/lon")
        coordinates = (
            Coordinate("lat", ("lat",), lat, {**geographic["lat"], "axis": "Y"}),
            Coordinate("lon", ("lon",), lon, {**geographic["lon"], "axis": "X"}),
        )
        return HorizontalGrid(("lat", "lon"), (lat.size, lon.size), coordinates)
    if y is None or x is None:
        raise ValueError("give both y and x")
    y, x = _to_numpy(y, "y").astype(np.float64), _to_numpy(x, "x").astype(np.float64)
    if y.ndim != 1 or x.ndim != 1:
        raise ValueError(f"y and x must be 1-D, got shapes {y.shape} and {x.shape}")
    coordinates = [
        Coordinate("y", ("y",), y, {"standard_name": "projection_y_coordinate", "units": xy_units, "axis": "Y"}),
        Coordinate("x", ("x",), x, {"standard_name": "projection_x_coordinate", "units": xy_units, "axis": "X"}),
    ]
    if (lat is None) != (lon is None):
        raise ValueError("give both lat and lon, or neither")
    if lat is not None:
        for name, values in (("lat", _to_numpy(lat, "lat")), ("lon", _to_numpy(lon, "lon"))):
            if values.shape != (y.size, x.size):
                raise ValueError(
                    f"with y and x, {name} must be 2-D (len(y), len(x)) = {(y.size, x.size)}, got {values.shape}"
                )
            coordinates.append(Coordinate(name, ("y", "x"), values.astype(np.float64), geographic[name]))
    auxiliary = ("lat", "lon") if lat is not None else ()
    return HorizontalGrid(("y", "x"), (y.size, x.size), tuple(coordinates), auxiliary)


class ForecastWriter:
    """Write a CF-1.8 netCDF4 forecast one time step at a time; the file takes its name on ``close``.

    ``variables`` are the output fields, each (H, W) per step, or (E, H, W) with
    ``ensemble_size=E``. ``units`` is required for every variable ("1" if dimensionless);
    ``long_names`` default to the variable names; ``variable_attrs`` adds further attributes per
    variable (its ``coordinates`` names are appended to the grid's). The grid is ``grid`` (a
    source's own coordinates) or made from ``y``/``x``/``lat``/``lon``. Times are dates (datetime,
    numpy or cftime) or numbers in ``time_units`` (default hours since ``reference_time``, the
    forecast initialisation time, also stored as ``forecast_reference_time``) and must increase;
    the time dimension and its coordinate are called ``time_name``.
    Use as a context manager: on an exception the partial file is removed.
    """

    def __init__(
        self,
        path: str | Path,
        variables: Sequence[str],
        *,
        reference_time: DateLike,
        units: Mapping[str, str],
        y: ArrayLike | None = None,
        x: ArrayLike | None = None,
        lat: ArrayLike | None = None,
        lon: ArrayLike | None = None,
        grid: HorizontalGrid | None = None,
        long_names: Mapping[str, str] | None = None,
        standard_names: Mapping[str, str] | None = None,
        variable_attrs: Mapping[str, Mapping[str, Any]] | None = None,
        ensemble_size: int | None = None,
        attrs: Mapping[str, Any] | None = None,
        title: str = "physics_dp forecast",
        calendar: str = "proleptic_gregorian",
        time_units: str | None = None,
        time_name: str = "time",
        xy_units: str = "m",
        compress: bool = True,
    ) -> None:
        missing = [name for name in variables if name not in units]
        if missing:
            raise ValueError(f"no units for {missing}: pass units={{name: 'K', ...}} ('1' for dimensionless)")
        if ensemble_size is not None and ensemble_size < 1:
            raise ValueError(f"ensemble_size must be at least 1, got {ensemble_size}")
        if grid is not None and any(v is not None for v in (y, x, lat, lon)):
            raise ValueError("give either grid= or y/x/lat/lon, not both")
        grid = grid if grid is not None else _grid(y, x, lat, lon, xy_units)
        self.path = Path(path)
        self.variables = tuple(variables)
        self.ensemble_size = ensemble_size
        self.reference_time = _as_datetime(reference_time)
        self.time_units = time_units or f"hours since {self.reference_time.strftime('%Y-%m-%d %H:%M:%S')}"
        self.calendar = calendar
        self.time_name = time_name
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._last_time: float | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {name: {"long_name": name, **(variable_attrs or {}).get(name, {})} for name in self.variables}
        for name in self.variables:
            metadata[name]["units"] = units[name]
            for key, given in (("long_name", long_names), ("standard_name", standard_names)):
                if name in (given or {}):
                    metadata[name][key] = given[name]
        created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        with NETCDF_LOCK:
            self._dataset = netCDF4.Dataset(self._partial, "w", format="NETCDF4")
            try:
                self._field_shape = self._define(grid, metadata, compress)
                self._dataset.setncatts(
                    {
                        "Conventions": CONVENTIONS,
                        "title": title,
                        "history": f"{created} written by physics_dp.data.cf_writer",
                        **(attrs or {}),
                    }
                )
            except BaseException:
                self.abort()
                raise

    def _define_grid(self, grid: HorizontalGrid) -> None:
        """The grid's dims (with any extra dims its coordinates use, such as bounds' vertices) and variables."""
        ds = self._dataset
        for dim, size in zip(grid.dims, grid.shape):
            ds.createDimension(dim, size)
        for coordinate in grid.coordinates:
            for dim, size in zip(coordinate.dims, coordinate.values.shape):
                if dim not in ds.dimensions:
                    ds.createDimension(dim, size)
                elif ds.dimensions[dim].size != size:
                    raise ValueError(
                        f"coordinate {coordinate.name!r} has {size} points along {dim!r}, which has {ds.dimensions[dim].size}"
                    )
        for coordinate in grid.coordinates:
            variable = ds.createVariable(coordinate.name, coordinate.values.dtype, coordinate.dims)
            variable.setncatts(coordinate.attrs)
            variable[...] = coordinate.values

    def _define(self, grid: HorizontalGrid, metadata: Mapping[str, Mapping[str, Any]], compress: bool) -> tuple[int, ...]:
        """Create dimensions, coordinate and data variables; return one step's field shape."""
        ds = self._dataset
        ds.createDimension(self.time_name, None)
        time = ds.createVariable(self.time_name, "f8", (self.time_name,))
        time_attrs = {"units": self.time_units, "calendar": self.calendar}
        time.setncatts({"standard_name": "time", "long_name": "time", "axis": "T", **time_attrs})
        reference = ds.createVariable("forecast_reference_time", "f8", ())
        reference.setncatts(
            {"standard_name": "forecast_reference_time", "long_name": "forecast initialisation time", **time_attrs}
        )
        reference.assignValue(self._time_value(self.reference_time))
        leading: tuple[str, ...] = (self.time_name,)
        if self.ensemble_size is not None:
            ds.createDimension("ensemble", self.ensemble_size)
            member = ds.createVariable("ensemble", "i4", ("ensemble",))
            member.setncatts({"standard_name": "realization", "long_name": "ensemble member", "units": "1"})
            member[:] = np.arange(self.ensemble_size, dtype=np.int32)
            leading += ("ensemble",)
        self._define_grid(grid)
        field_shape = tuple(ds.dimensions[d].size for d in leading[1:] + grid.dims)
        for name in self.variables:
            variable = ds.createVariable(
                name,
                "f4",
                leading + grid.dims,
                fill_value=FILL_VALUE,
                zlib=compress,
                complevel=1,
                chunksizes=(1,) * len(leading) + field_shape[-2:],
            )
            attrs = dict(metadata[name])
            listed = ["forecast_reference_time", *grid.auxiliary, *str(attrs.get("coordinates", "")).split()]
            attrs["coordinates"] = " ".join(dict.fromkeys(listed))
            variable.setncatts(attrs)
        return field_shape

    @property
    def steps(self) -> int:
        """Time steps written so far."""
        with NETCDF_LOCK:
            return len(self._dataset.dimensions[self.time_name])

    def _time_value(self, time: TimeLike) -> float:
        if isinstance(time, (datetime, np.datetime64, cftime.datetime)):
            return float(netCDF4.date2num(_as_datetime(time), self.time_units, self.calendar))
        return float(time)

    def write(self, time: TimeLike, fields: Mapping[str, ArrayLike]) -> None:
        """Append one time step: ``fields[name]`` is (H, W), or (E, H, W) for an ensemble, for every variable."""
        if set(fields) != set(self.variables):
            raise ValueError(f"write got fields {sorted(fields)} but the file declares {sorted(self.variables)}")
        value = self._time_value(time)
        if self._last_time is not None and value <= self._last_time:
            raise ValueError(f"times must increase: {value} after {self._last_time} ({self.time_units})")
        arrays = {}
        for name in self.variables:
            values = _to_numpy(fields[name], name)
            if values.shape != self._field_shape:
                raise ValueError(f"field {name!r} has shape {values.shape}, expected {self._field_shape} per step")
            arrays[name] = np.ma.masked_invalid(values.astype(np.float32))
        with NETCDF_LOCK:
            index = self.steps
            for name, values in arrays.items():
                self._dataset[name][index] = values
            self._dataset[self.time_name][index] = value
        self._last_time = value

    def close(self) -> Path:
        """Finish the file and move it to its final name; returns that path."""
        with NETCDF_LOCK:
            self._dataset.close()
        os.replace(self._partial, self.path)
        return self.path

    def abort(self) -> None:
        """Close and delete the partial file (nothing appears under the final name)."""
        with NETCDF_LOCK:
            if self._dataset.isopen():
                self._dataset.close()
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> ForecastWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_forecast_netcdf(
    path: str | Path,
    data: Mapping[str, ArrayLike],
    *,
    times: Sequence[TimeLike],
    units: Mapping[str, str],
    y: ArrayLike | None = None,
    x: ArrayLike | None = None,
    lat: ArrayLike | None = None,
    lon: ArrayLike | None = None,
    long_names: Mapping[str, str] | None = None,
    attrs: Mapping[str, Any] | None = None,
    ensemble: bool = False,
    reference_time: DateLike | None = None,
    **writer_options: Any,
) -> Path:
    """Write whole forecasts ``data[name]`` of shape (T, H, W), or (T, E, H, W) with ``ensemble=True``.

    ``reference_time`` defaults to the first time when times are datetimes; with times in hours it
    is required. Other options (``grid``, ``standard_names``, ``variable_attrs``, ``title``,
    ``calendar``, ``time_units``, ``time_name``, ``xy_units``, ``compress``) go to ``ForecastWriter``. Returns the path written.
    """
    if not data:
        raise ValueError("write_forecast_netcdf needs at least one variable in data")
    arrays = {name: _to_numpy(values, name) for name, values in data.items()}
    expected_ndim = 4 if ensemble else 3
    layout = "(T, E, H, W)" if ensemble else "(T, H, W)"
    shapes = {name: values.shape for name, values in arrays.items()}
    first = next(iter(shapes.values()))
    if any(len(shape) != expected_ndim for shape in shapes.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"every variable must be {layout} of one shape (ensemble={ensemble}), got {shapes}")
    if first[0] != len(times):
        raise ValueError(f"data has {first[0]} time steps but {len(times)} times were given")
    if reference_time is None:
        if not times or not isinstance(times[0], (datetime, np.datetime64, cftime.datetime)):
            raise ValueError("times are in hours: pass reference_time=datetime(...) (the forecast initialisation time)")
        reference_time = times[0]
    with ForecastWriter(
        path,
        list(arrays),
        reference_time=reference_time,
        units=units,
        y=y,
        x=x,
        lat=lat,
        lon=lon,
        long_names=long_names,
        ensemble_size=first[1] if ensemble else None,
        attrs=attrs,
        **writer_options,
    ) as writer:
        for step, time in enumerate(times):
            writer.write(time, {name: values[step] for name, values in arrays.items()})
    return writer.path
