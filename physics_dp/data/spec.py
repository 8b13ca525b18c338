"""The data configuration and what it resolves to: catalogs of the files, split time ranges, time matching.

Shared by the dataset and the statistics so that both see the same files, variables and ranges.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .catalog import Catalog, Grid
from .files import resolve_paths
from .times import check_one_calendar, describe_time

SPLITS = ("train", "valid")


@dataclass
class DataSpec:
    """Plain data config (the trainer maps its Hydra config onto it).

    ``train_times`` / ``valid_times`` are [start, stop) indices of the concatenated time axis that a
    split's samples may touch (inputs and targets); None means the whole axis. ``level`` indexes
    the non-singleton non-spatial dim of any variable that has one (state, background, invariants).
    """

    state_files: str | list[str]
    state_variables: list[str]
    background_files: str | list[str] | None = None
    background_variables: Sequence[str] = ()
    invariant_file: str | None = None
    invariant_variables: Sequence[str] = ()
    level: int | None = None
    lead_time: int = 1
    train_times: tuple[int, int] | None = None
    valid_times: tuple[int, int] | None = None
    stats_file: str | None = None

    def __post_init__(self) -> None:
        if not self.state_variables:
            raise ValueError("DataSpec.state_variables is empty; list the state variables to read")
        if int(self.lead_time) < 1:
            raise ValueError(f"DataSpec.lead_time={self.lead_time}; it must be a positive number of time steps")
        if self.background_variables and self.background_files is None:
            raise ValueError("DataSpec.background_variables is set but background_files is None; give the background files")
        if self.invariant_variables and self.invariant_file is None:
            raise ValueError("DataSpec.invariant_variables is set but invariant_file is None; give the invariant file")


@dataclass
class Catalogs:
    """The opened file sets of one spec (background and invariants only when variables are asked for)."""

    state: Catalog
    background: Catalog | None
    invariants: Catalog | None

    def all(self) -> dict[str, Catalog]:
        found = {"state": self.state, "background": self.background, "invariants": self.invariants}
        return {role: catalog for role, catalog in found.items() if catalog is not None}

    def close(self) -> None:
        for catalog in self.all().values():
            catalog.close()


def open_catalogs(spec: DataSpec) -> Catalogs:
    """Open and check the spec's file sets (closing what was opened if any check fails)."""
    catalogs = Catalogs(
        Catalog(resolve_paths(spec.state_files, "state_files"), spec.state_variables, role="state", level=spec.level),
        None,
        None,
    )
    try:
        if spec.background_variables:
            catalogs.background = Catalog(
                resolve_paths(spec.background_files, "background_files"),
                spec.background_variables,
                role="background",
                level=spec.level,
            )
        if spec.invariant_variables:
            catalogs.invariants = Catalog(
                resolve_paths(spec.invariant_file, "invariant_file"),
                spec.invariant_variables,
                role="invariant",
                level=spec.level,
                timed=False,
            )
            _check_invariant_grid(catalogs.invariants.grid, catalogs.state.grid)
    except Exception:
        catalogs.close()
        raise
    return catalogs


def _check_invariant_grid(invariants: Grid, state: Grid) -> None:
    if not invariants.matches(state):
        raise ValueError(
            f"the invariants are on a {invariants.shape[0]}x{invariants.shape[1]} grid but the state is on "
            f"{state.shape[0]}x{state.shape[1]}"
            f"{' (same shape, different coordinates)' if invariants.shape == state.shape else ''}; "
            "regrid the invariants to the state grid"
        )


def split_range(spec: DataSpec, split: str, n_times: int) -> tuple[int, int]:
    """The [start, stop) time indices a split may touch, checked to hold at least one sample."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    field = f"{split}_times"
    chosen = getattr(spec, field)
    start, stop = (0, n_times) if chosen is None else (int(chosen[0]), int(chosen[1]))
    if not 0 <= start < stop <= n_times:
        raise ValueError(
            f"DataSpec.{field}=({start}, {stop}) is empty or out of range for {n_times} time steps; "
            f"use [start, stop) with 0 <= start < stop <= {n_times}"
        )
    if stop - start <= spec.lead_time:
        raise ValueError(
            f"DataSpec.{field}=({start}, {stop}) holds {stop - start} time steps, too few for lead_time="
            f"{spec.lead_time}: a sample needs {spec.lead_time + 1}; widen the range"
        )
    return start, stop


def match_times(state: Catalog, background: Catalog, times: range) -> np.ndarray:
    """Background time index of each state time index in `times` (equal time values in one calendar)."""
    check_one_calendar({"state files": state.calendar, "background files": background.calendar}, "state and background")
    where = np.searchsorted(background.seconds, state.seconds[times.start : times.stop])
    where = np.minimum(where, max(background.n_times - 1, 0))
    found = background.seconds[where] == state.seconds[times.start : times.stop]
    if not found.all():
        t = times.start + int(np.flatnonzero(~found)[0])
        raise ValueError(
            f"the background files have no data at {describe_time(state.hours(t), state.calendar)} (state time index {t}), "
            f"needed as background at t + lead_time; add background files covering the state times"
        )
    return where


def default_stats_file(spec: DataSpec) -> str:
    if spec.stats_file is not None:
        return os.fspath(spec.stats_file)
    first = resolve_paths(spec.state_files, "state_files")[0]
    return os.path.join(os.path.dirname(first), "physics_dp_stats.json")
