"""A set of netCDF files seen as one collection: each variable on one (y, x) grid along one time axis.

Files may split the time axis (concatenated in time order) and the variables (merged by name), so
the catalog records, for every variable and global time index, the file and the local index that
hold it. Reads are hyperslabs ``var[t, r0:r1, c0:c1]``, counted so tests can check what each rank
read from disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import cftime
import netCDF4
import numpy as np
import torch.distributed as dist

from .files import NETCDF_LOCK, FilePool
from .times import TimeCoordinate, check_one_calendar, describe_time, find_time_coordinate, to_date

Window = tuple[tuple[int, int], tuple[int, int]]


class DataReadError(OSError):
    """A hyperslab could not be read from a file (damaged chunk, I/O error); names everything to find it."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass(frozen=True)
class Grid:
    """The horizontal grid of a variable: extents, dim names, and 1-D coordinates when the file has them."""

    shape: tuple[int, int]
    dims: tuple[str, str]
    y: np.ndarray | None
    x: np.ndarray | None

    def matches(self, other: Grid) -> bool:
        if self.shape != other.shape:
            return False
        for mine, theirs in ((self.y, other.y), (self.x, other.x)):
            if mine is not None and theirs is not None and not np.allclose(mine, theirs, rtol=0, atol=1e-6):
                return False
        return True


@dataclass
class ReadCounts:
    """What was read from disk, per variable: element totals and the distinct (rows, cols) windows."""

    reads: int = 0
    elements: dict[str, int] = field(default_factory=dict)
    windows: dict[str, set[Window]] = field(default_factory=dict)

    @property
    def total_elements(self) -> int:
        return sum(self.elements.values())

    def record(self, name: str, window: Window, n: int) -> None:
        self.reads += 1
        self.elements[name] = self.elements.get(name, 0) + n
        self.windows.setdefault(name, set()).add(window)


@dataclass(frozen=True)
class _Layout:
    """Where (time, y, x) sit in a variable's dims, and the fixed index of every other dim."""

    ndim: int
    time_axis: int | None
    fixed: tuple[tuple[int, int], ...]

    def index(self, local_t: int | None, rows: tuple[int, int], cols: tuple[int, int]) -> tuple:
        index: list = [None] * self.ndim
        index[-2] = slice(*rows)
        index[-1] = slice(*cols)
        for axis, i in self.fixed:
            index[axis] = i
        if self.time_axis is not None:
            index[self.time_axis] = local_t
        return tuple(index)


def _data_variables(ds: netCDF4.Dataset) -> list[str]:
    return [name for name, var in ds.variables.items() if var.dimensions != (name,)]


def _layout(var: netCDF4.Variable, path: str, role: str, time_dim: str | None, level: int | None, timed: bool) -> _Layout:
    """Map a variable's dims onto (time, y, x): singleton dims are squeezed, one larger dim takes `level`."""
    dims, shape = var.dimensions, var.shape
    where = f"{role} variable {var.name!r} in {path}"
    if len(dims) < 2 or time_dim in dims[-2:]:
        raise ValueError(f"{where} has dims {dims}; its last two dims must be the spatial (y, x) dims")
    time_axis = dims.index(time_dim) if time_dim in dims else None
    if timed and time_axis is None:
        raise ValueError(
            f"{where} has no time dim (dims {dims}); put time-independent fields in the invariant file"
        )
    fixed, levels = [], []
    if not timed and time_axis is not None:
        if shape[time_axis] != 1:
            raise ValueError(
                f"{where} has {shape[time_axis]} time steps; invariants must be time-independent "
                "(no time dim, or a single time step)"
            )
        fixed.append((time_axis, 0))
    for axis in range(len(dims) - 2):
        if axis == time_axis:
            continue
        if shape[axis] == 1:
            fixed.append((axis, 0))
        else:
            levels.append(axis)
    if not timed:
        time_axis = None
    if len(levels) > 1:
        raise ValueError(
            f"{where} has several non-singleton dims {[dims[a] for a in levels]}; only one level dim is "
            "supported: split the variable or reduce the others"
        )
    for axis in levels:
        size = shape[axis]
        if level is None:
            raise ValueError(
                f"{where} has dim {dims[axis]!r} of size {size}; set DataSpec.level to pick one index (0..{size - 1})"
            )
        if not 0 <= level < size:
            raise ValueError(
                f"DataSpec.level={level} is out of range for dim {dims[axis]!r} (size {size}) of {where}; "
                f"use 0..{size - 1}"
            )
        fixed.append((axis, level))
    return _Layout(ndim=len(dims), time_axis=time_axis, fixed=tuple(fixed))


def _grid(ds: netCDF4.Dataset, var: netCDF4.Variable) -> Grid:
    dims = var.dimensions[-2:]
    shape = var.shape[-2:]
    coords = []
    for dim, size in zip(dims, shape):
        coord = ds.variables.get(dim)
        ok = coord is not None and coord.dimensions == (dim,) and coord.shape == (size,)
        coords.append(np.asarray(coord[:], dtype=np.float64) if ok else None)
    return Grid(shape=(int(shape[0]), int(shape[1])), dims=(dims[0], dims[1]), y=coords[0], x=coords[1])


class Catalog:
    """Variables of a file set on one grid, indexed by a global time axis (or time-independent)."""

    def __init__(
        self,
        paths: Sequence[str],
        variables: Sequence[str],
        *,
        role: str,
        level: int | None = None,
        timed: bool = True,
    ) -> None:
        self.role = role
        self.variables = list(variables)
        self.timed = timed
        self.paths = list(paths)
        self.counts = ReadCounts()
        self._pool = FilePool()
        self._layouts: dict[tuple[str, str], _Layout] = {}
        self.time_coordinates: dict[str, TimeCoordinate] = {}  # per timed file
        self.calendar = "standard"
        self.seconds = np.zeros(0, dtype=np.int64)
        self._file_of: dict[str, np.ndarray] = {}
        self._local_of: dict[str, np.ndarray] = {}
        try:
            self._holders = self._locate(level)
            self.grid = self._check_grids(self._holders)
            if timed:
                self._index_times(self._holders)
        except Exception:
            self._pool.close()
            raise

    # ----- construction -------------------------------------------------------------------------
    def _locate(self, level: int | None) -> dict[str, list[str]]:
        """For each variable, the files holding it; layouts for each (file, variable)."""
        holders: dict[str, list[str]] = {name: [] for name in self.variables}
        available: set[str] = set()
        with NETCDF_LOCK:
            for path in self.paths:
                ds = self._pool.get(path)
                available.update(_data_variables(ds))
                wanted = [name for name in self.variables if name in ds.variables]
                if not wanted:
                    continue
                time = find_time_coordinate(ds, wanted, path, decodable=self.timed)
                time_dim = time.dim if time is not None else ("time" if "time" in ds.dimensions else None)
                if self.timed and time is None:
                    raise ValueError(
                        f"{self.role} file {path} holds {wanted[0]!r} but has no time coordinate (a 1-D variable "
                        "'time' or one with axis='T' and units, or a time variable named in the data variable's "
                        "'coordinates' attribute); add one"
                    )
                if self.timed:
                    self.time_coordinates[path] = time
                for name in wanted:
                    holders[name].append(path)
                    self._layouts[(path, name)] = _layout(ds.variables[name], path, self.role, time_dim, level, self.timed)
        for name, files in holders.items():
            if not files:
                raise ValueError(
                    f"{self.role} variable {name!r} not found in {len(self.paths)} file(s) {self._short(self.paths)}; "
                    f"available variables: {sorted(available)}; fix the {self.role} variable list or the file list"
                )
            if not self.timed and len(files) > 1:
                raise ValueError(f"{self.role} variable {name!r} is in several files {files}; keep one copy")
        return holders

    def _check_grids(self, holders: dict[str, list[str]]) -> Grid:
        reference: tuple[str, str, Grid] | None = None
        with NETCDF_LOCK:
            for name, files in holders.items():
                for path in files:
                    ds = self._pool.get(path)
                    grid = _grid(ds, ds.variables[name])
                    if reference is None:
                        reference = (name, path, grid)
                    elif not grid.matches(reference[2]):
                        ref_name, ref_path, ref = reference
                        raise ValueError(
                            f"{self.role} variables are on different grids: {ref_name!r} in {ref_path} is "
                            f"{ref.shape[0]}x{ref.shape[1]} but {name!r} in {path} is {grid.shape[0]}x{grid.shape[1]}"
                            f"{' (or has different coordinates)' if grid.shape == ref.shape else ''}; "
                            "regrid them to one grid"
                        )
        assert reference is not None
        return reference[2]

    def _index_times(self, holders: dict[str, list[str]]) -> None:
        """Build the global time axis (union of all files' times) and each variable's (file, local) map."""
        self.calendar = check_one_calendar({path: t.calendar for path, t in self.time_coordinates.items()}, self.role)
        local_seconds: dict[str, np.ndarray] = {}
        with NETCDF_LOCK:
            for path, time in self.time_coordinates.items():
                hours = time.hours(self._pool.get(path))
                local_seconds[path] = np.round(hours * 3600.0).astype(np.int64)
        self.seconds = np.unique(np.concatenate(list(local_seconds.values())))
        for name, files in holders.items():
            file_of = np.full(len(self.seconds), -1, dtype=np.int64)
            local_of = np.full(len(self.seconds), -1, dtype=np.int64)
            for path in files:
                where = np.searchsorted(self.seconds, local_seconds[path])
                clash = file_of[where] >= 0
                if clash.any():
                    other = self.paths[file_of[where][clash][0]]
                    raise ValueError(
                        f"{self.role} variable {name!r} appears twice at {self._when(where[clash][0])}: in {other} "
                        f"and {path}; remove the overlapping file"
                    )
                file_of[where] = self.paths.index(path)
                local_of[where] = np.arange(len(where))
            missing = np.flatnonzero(file_of < 0)
            if missing.size:
                raise ValueError(
                    f"{self.role} variable {name!r} has no data for {missing.size} of {len(self.seconds)} times "
                    f"(first missing: {self._when(missing[0])}; files holding it: {self._short(files)}); add the "
                    "files holding those times, or keep only files with the same times"
                )
            self._file_of[name] = file_of
            self._local_of[name] = local_of

    # ----- queries ------------------------------------------------------------------------------
    @property
    def n_times(self) -> int:
        return len(self.seconds)

    def hours(self, t: int) -> float:
        return float(self.seconds[t]) / 3600.0

    @property
    def time_units(self) -> str:
        """The time units of the file holding the first time (what outputs of these files use)."""
        first = self.paths[int(self._file_of[self.variables[0]][0])]
        return self.time_coordinates[first].units

    def files_of(self, name: str) -> list[str]:
        """The files holding variable ``name``, in the order given."""
        return list(self._holders[name])

    def date(self, t: int) -> datetime | cftime.datetime:
        """The date of global time index ``t`` in the files' calendar (a cftime datetime)."""
        return to_date(self.hours(t), self.calendar)

    def _when(self, t: int) -> str:
        return f"time index {t} ({describe_time(self.hours(t), self.calendar)})"

    @staticmethod
    def _short(paths: Sequence[str]) -> str:
        return str(list(paths[:3]) + (["..."] if len(paths) > 3 else []))

    def read(self, name: str, t: int | None, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """One hyperslab as (float64 values, bool valid); missing points (fill values) are invalid."""
        if self.timed:
            path = self.paths[self._file_of[name][t]]
            local = int(self._local_of[name][t])
        else:
            path, local = self._holders[name][0], None
        index = self._layouts[(path, name)].index(local, rows, cols)
        try:
            with NETCDF_LOCK:
                raw = self._pool.get(path).variables[name][index]
        except Exception as error:  # netCDF4/HDF5 say only "NetCDF: HDF error"
            when = f"{self._when(t)} (index {local} in the file)" if self.timed else "its only time"
            raise DataReadError(
                f"rank {_rank()} could not read {self.role} variable {name!r} at {when}, rows {rows}, cols {cols} from "
                f"{path}: {type(error).__name__}: {error}. The file may be damaged (check it with ncdump, or re-copy it)"
            ) from error
        values = np.ma.getdata(raw).astype(np.float64)
        valid = ~np.ma.getmaskarray(raw)
        if np.isnan(values[valid]).any():
            when = f" at {self._when(t)}" if self.timed else ""
            raise ValueError(
                f"{self.role} variable {name!r} in {path} has NaN values{when} but no _FillValue or "
                "missing_value marks them; set _FillValue=NaN (or missing_value) on the variable, or remove the NaNs"
            )
        self.counts.record(name, (rows, cols), values.size)
        return values, valid

    def close(self) -> None:
        self._pool.close()
