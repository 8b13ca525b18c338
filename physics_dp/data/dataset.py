"""Map-style weather dataset reading one rank's hyperslab of every field from netCDF files.

A domain-parallel rank owns rows [r0, r1) x cols [c0, c1) of the state grid; it reads only those
from disk, and for the coarser background only the source rows/cols its bilinear taps touch. The
sample equals the matching slice of a whole-grid sample, so sharded and single-device training
see the same data.
"""

from __future__ import annotations

import numpy as np
import torch

from .catalog import Catalog, ReadCounts
from .regrid import interpolate, linear_taps
from .spec import DataSpec, match_times, open_catalogs, split_range
from .stats import ChannelStats, Stats, load_or_compute_stats

__all__ = ["DataSpec", "WeatherDataset"]


def _window(value: tuple[int, int] | None, extent: int, name: str) -> tuple[int, int]:
    if value is None:
        return 0, extent
    start, stop = int(value[0]), int(value[1])
    if not 0 <= start < stop <= extent:
        raise ValueError(f"{name}=({start}, {stop}) is out of range for a grid extent of {extent}; use 0 <= start < stop <= {extent}")
    return start, stop


class WeatherDataset(torch.utils.data.Dataset):
    """One sample per time index t of the split: state at t, target/background at t + lead_time.

    Keys: "state" (C,h,w), "target" (C,h,w), "mask" (C,h,w) bool, True where the target is valid,
    "background" (Cb,h,w) bilinearly interpolated to the state grid (if any), "invariants" (Ci,h,w)
    (if any), "time_index" (global time index t). Normalized with the train split's statistics;
    missing points are 0 (after normalization).
    """

    def __init__(
        self,
        spec: DataSpec,
        split: str = "train",
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        normalize: bool = True,
        stats: Stats | None = None,
    ) -> None:
        self.spec = spec
        self.split = split
        self._catalogs = open_catalogs(spec)
        try:
            self._setup(rows, cols, normalize, stats)
        except Exception:
            self._catalogs.close()
            raise

    def _setup(self, rows: tuple[int, int] | None, cols: tuple[int, int] | None, normalize: bool, stats: Stats | None) -> None:
        state = self._catalogs.state
        self.grid_shape: tuple[int, int] = state.grid.shape
        self.rows = _window(rows, self.grid_shape[0], "rows")
        self.cols = _window(cols, self.grid_shape[1], "cols")
        self._start, stop = split_range(self.spec, self.split, state.n_times)
        self._length = stop - self._start - self.spec.lead_time
        self.channel_names: dict[str, list[str]] = {role: list(c.variables) for role, c in self._catalogs.all().items()}
        self._background_times: np.ndarray | None = None
        if self._catalogs.background is not None:
            first = self._start + self.spec.lead_time
            self._background_times = match_times(state, self._catalogs.background, range(first, stop))
            self._setup_background(state, self._catalogs.background)
        self.stats: Stats | None = None
        if normalize:
            self.stats = stats if stats is not None else load_or_compute_stats(self.spec)
            self._check_stats(self.stats)
        self._invariants = self._read_invariants()

    def _setup_background(self, state: Catalog, background: Catalog) -> None:
        """Interpolation taps for this window, and the background rows/cols they read."""
        taps = []
        for axis, window in enumerate((self.rows, self.cols)):
            target = (state.grid.y, state.grid.x)[axis]
            source = (background.grid.y, background.grid.x)[axis]
            for role, grid, coord in (("state", state.grid, target), ("background", background.grid, source)):
                if coord is None:
                    raise ValueError(
                        f"interpolating the background needs 1-D coordinates, but the {role} files have no "
                        f"coordinate variable for dim {grid.dims[axis]!r}; add one (e.g. y/x or lat/lon)"
                    )
            taps.append(linear_taps(source, target, background.grid.dims[axis]).sub(*window))
        (self._bg_rows, self._row_taps), (self._bg_cols, self._col_taps) = taps

    def _check_stats(self, stats: Stats) -> None:
        for role, names in self.channel_names.items():
            group = stats.groups.get(role)
            if group is None or list(group.names) != names:
                have = None if group is None else list(group.names)
                raise ValueError(
                    f"the given stats have {role} channels {have} but the dataset has {names}; "
                    "compute stats for this DataSpec (load_or_compute_stats(spec))"
                )

    # ----- reading ------------------------------------------------------------------------------
    def _normalized(self, role: str, values: np.ndarray, valid: np.ndarray) -> torch.Tensor:
        if self.stats is not None:
            group: ChannelStats = self.stats.groups[role]
            values = (values - group.mean[:, None, None]) / group.std[:, None, None]
        return torch.from_numpy(np.where(valid, values, 0.0).astype(np.float32))

    def _read_stack(self, catalog: Catalog, t: int | None) -> tuple[np.ndarray, np.ndarray]:
        pairs = [catalog.read(name, t, self.rows, self.cols) for name in catalog.variables]
        return np.stack([v for v, _ in pairs]), np.stack([ok for _, ok in pairs])

    def _read_background(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        catalog = self._catalogs.background
        assert catalog is not None
        fields = []
        for name in catalog.variables:
            values, valid = catalog.read(name, t, self._bg_rows, self._bg_cols)
            fields.append(interpolate(values, valid, self._row_taps, self._col_taps))
        return np.stack([v for v, _ in fields]), np.stack([ok for _, ok in fields])

    def _read_invariants(self) -> torch.Tensor | None:
        if self._catalogs.invariants is None:
            return None
        return self._normalized("invariants", *self._read_stack(self._catalogs.invariants, None))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not -self._length <= i < self._length:
            raise IndexError(f"sample {i} is out of range for a {self.split} split of {self._length} samples")
        i %= self._length
        t = self._start + i
        state = self._catalogs.state
        sample = {"state": self._normalized("state", *self._read_stack(state, t))}
        target, valid = self._read_stack(state, t + self.spec.lead_time)
        sample["target"] = self._normalized("state", target, valid)
        sample["mask"] = torch.from_numpy(valid)
        if self._background_times is not None:
            sample["background"] = self._normalized("background", *self._read_background(int(self._background_times[i])))
        if self._invariants is not None:
            sample["invariants"] = self._invariants.clone()
        sample["time_index"] = torch.tensor(t, dtype=torch.int64)
        return sample

    # ----- introspection ------------------------------------------------------------------------
    def read_counts(self) -> dict[str, ReadCounts]:
        """Disk reads since construction (or the last reset), per group: element totals and windows."""
        return {role: catalog.counts for role, catalog in self._catalogs.all().items()}

    def reset_read_counts(self) -> None:
        for catalog in self._catalogs.all().values():
            catalog.counts = ReadCounts()

    def close(self) -> None:
        self._catalogs.close()
