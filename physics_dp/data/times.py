"""Finding a file's CF time coordinate and turning its values into comparable numbers and dates.

Why not just the variable named ``time``: some models write a time dimension whose own variable
holds no real times (no units, often all zeros) and keep the times in an auxiliary coordinate that
the data variables name in their ``coordinates`` attribute (standard_name ``time``). CF readers
use that one, and so do we. Why cftime: climate models write 360_day, noleap and other calendars
whose dates Python's datetime cannot hold; times are kept as hours since 1970-01-01 *in the file's
calendar*, which orders and matches them within one calendar, and dates are rebuilt with cftime.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import cftime
import netCDF4
import numpy as np

EPOCH_UNITS = "hours since 1970-01-01 00:00:00"
_STANDARD = {"standard", "gregorian", "proleptic_gregorian"}


@dataclass(frozen=True)
class TimeCoordinate:
    """Where a file keeps its times: the variable, the dim it runs along, its units and calendar."""

    variable: str
    dim: str
    units: str
    calendar: str

    def hours(self, ds: netCDF4.Dataset) -> np.ndarray:
        """The times as float hours since 1970 in the file's calendar (files with other units compare equal)."""
        values = np.asarray(ds.variables[self.variable][:], dtype=np.float64)
        dates = cftime.num2date(values, self.units, calendar=self.calendar)
        return np.asarray(cftime.date2num(dates, EPOCH_UNITS, calendar=self.calendar), dtype=np.float64)


def _has_time_units(var: netCDF4.Variable) -> bool:
    return " since " in str(getattr(var, "units", ""))


def _is_time(var: netCDF4.Variable) -> bool:
    return getattr(var, "standard_name", "") == "time" or getattr(var, "axis", "") == "T"


def _coordinate(var: netCDF4.Variable) -> TimeCoordinate:
    calendar = str(getattr(var, "calendar", "standard")).lower()
    return TimeCoordinate(var.name, var.dimensions[0], str(var.units), calendar)


def _dimension_coordinate(ds: netCDF4.Dataset) -> netCDF4.Variable | None:
    """A 1-D variable named after its dim, called 'time' or marked standard_name='time' / axis='T'."""
    for name, var in ds.variables.items():
        if var.dimensions == (name,) and (name == "time" or _is_time(var)):
            return var
    return None


def _auxiliary_coordinate(ds: netCDF4.Dataset, variables: Iterable[str]) -> netCDF4.Variable | None:
    """A 1-D time variable with units named by a data variable's ``coordinates`` attribute."""
    for name in variables:
        var = ds.variables.get(name)
        if var is None:
            continue
        for coordinate in str(getattr(var, "coordinates", "")).split():
            aux = ds.variables.get(coordinate)
            if (
                aux is not None
                and len(aux.dimensions) == 1
                and aux.dimensions[0] in var.dimensions
                and _is_time(aux)
                and _has_time_units(aux)
            ):
                return aux
    return None


def find_time_coordinate(
    ds: netCDF4.Dataset, variables: Iterable[str], path: str, *, decodable: bool = True
) -> TimeCoordinate | None:
    """The CF time coordinate of ``variables`` in ``ds``: the dimension coordinate if it has units,
    else the auxiliary coordinate with standard_name 'time' that their ``coordinates`` attribute
    names; None when the file has neither (time-independent files). A dimension coordinate without
    units is an error when the times must be ``decodable``, else returned with empty units (its dim
    is all a time-independent file needs)."""
    dimension = _dimension_coordinate(ds)
    if dimension is not None and _has_time_units(dimension):
        return _coordinate(dimension)
    auxiliary = _auxiliary_coordinate(ds, variables)
    if auxiliary is not None:
        return _coordinate(auxiliary)
    if dimension is not None and not decodable:
        return TimeCoordinate(dimension.name, dimension.dimensions[0], "", "standard")
    if dimension is not None:
        raise ValueError(
            f"the time coordinate {dimension.name!r} in {path} has no units (e.g. 'hours since 2000-01-01') and no "
            "data variable names a time variable with units in its 'coordinates' attribute; add units to "
            f"{dimension.name!r} (and a calendar if it is not the standard one)"
        )
    return None


def check_one_calendar(calendars: dict[str, str], role: str) -> str:
    """The one calendar of a file set ({path: calendar}); mixing calendars is an error."""
    found = list(dict.fromkeys(calendars.values()))
    if not found:
        return "standard"
    if len(found) > 1 and not set(found) <= _STANDARD:
        detail = ", ".join(f"{path}: {calendar}" for path, calendar in calendars.items())
        raise ValueError(
            f"the {role} files use different calendars ({detail}); times of different calendars cannot be "
            "matched: convert the files to one calendar"
        )
    return found[0]


def to_date(hours: float, calendar: str) -> datetime | cftime.datetime:
    """The date ``hours`` after 1970-01-01 in ``calendar``: a datetime in the standard calendars, else cftime's."""
    return cftime.num2date(float(hours), EPOCH_UNITS, calendar=calendar, only_use_cftime_datetimes=False)


def describe_time(hours: float, calendar: str = "standard") -> str:
    """A readable date for error messages."""
    return f"{to_date(hours, calendar).strftime('%Y-%m-%d %H:%M:%S')} ({calendar} calendar)"
