"""Per-channel normalization statistics over the train split, streamed one time step at a time.

Moments are merged per step in float64 with Chan's formula (stable for long records), missing
points are left out, and the result is cached in a JSON file keyed by a fingerprint of the files
(path, size, mtime), variables, level, lead time and train range, so a changed input recomputes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from .catalog import Catalog
from .spec import Catalogs, DataSpec, default_stats_file, match_times, open_catalogs, split_range

GROUPS = ("state", "background", "invariants")


@dataclass(frozen=True)
class ChannelStats:
    """Mean and std per channel; a constant channel gets std 1 so normalizing it gives zeros, not NaNs."""

    names: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray
    count: np.ndarray

    def to_json(self) -> dict:
        return {"names": list(self.names), "mean": self.mean.tolist(), "std": self.std.tolist(), "count": self.count.tolist()}

    @classmethod
    def from_json(cls, data: dict) -> ChannelStats:
        return cls(
            names=tuple(data["names"]),
            mean=np.asarray(data["mean"], dtype=np.float64),
            std=np.asarray(data["std"], dtype=np.float64),
            count=np.asarray(data["count"], dtype=np.int64),
        )


@dataclass(frozen=True)
class Stats:
    """Statistics of each channel group present in the spec ("state", "background", "invariants")."""

    fingerprint: str
    groups: dict[str, ChannelStats]

    def to_json(self) -> dict:
        return {"fingerprint": self.fingerprint, "groups": {k: v.to_json() for k, v in self.groups.items()}}

    @classmethod
    def from_json(cls, data: dict) -> Stats:
        return cls(data["fingerprint"], {k: ChannelStats.from_json(v) for k, v in data["groups"].items()})


class _Moments:
    """Running count, mean and sum of squared deviations per channel (float64)."""

    def __init__(self, n_channels: int) -> None:
        self.count = np.zeros(n_channels, dtype=np.int64)
        self.mean = np.zeros(n_channels, dtype=np.float64)
        self.m2 = np.zeros(n_channels, dtype=np.float64)

    def add(self, channel: int, values: np.ndarray) -> None:
        n_b = values.size
        if n_b == 0:
            return
        mean_b = float(values.mean())
        m2_b = float(np.square(values - mean_b).sum())
        n_a = int(self.count[channel])
        n = n_a + n_b
        delta = mean_b - self.mean[channel]
        self.mean[channel] += delta * n_b / n
        self.m2[channel] += m2_b + delta * delta * n_a * n_b / n
        self.count[channel] = n

    def finish(self, names: list[str], role: str) -> ChannelStats:
        empty = [name for name, n in zip(names, self.count) if n == 0]
        if empty:
            raise ValueError(
                f"{role} variables {empty} have no valid (non-missing) value in the train split; "
                "check their _FillValue or widen DataSpec.train_times"
            )
        std = np.sqrt(self.m2 / self.count)
        return ChannelStats(tuple(names), self.mean.copy(), np.where(std > 0, std, 1.0), self.count.copy())


def _accumulate(catalog: Catalog, times: list[int | None]) -> ChannelStats:
    moments = _Moments(len(catalog.variables))
    rows, cols = (0, catalog.grid.shape[0]), (0, catalog.grid.shape[1])
    for t in times:
        for channel, name in enumerate(catalog.variables):
            values, valid = catalog.read(name, t, rows, cols)
            moments.add(channel, values[valid])
    return moments.finish(catalog.variables, catalog.role)


def _fingerprint(spec: DataSpec, catalogs: Catalogs, train: tuple[int, int]) -> str:
    files = {
        role: [[path, os.stat(path).st_size, os.stat(path).st_mtime_ns] for path in catalog.paths]
        for role, catalog in catalogs.all().items()
    }
    variables = {role: catalog.variables for role, catalog in catalogs.all().items()}
    payload = {"files": files, "variables": variables, "level": spec.level, "lead_time": spec.lead_time, "train": train}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _compute(spec: DataSpec, catalogs: Catalogs) -> Stats:
    start, stop = split_range(spec, "train", catalogs.state.n_times)
    groups = {"state": _accumulate(catalogs.state, list(range(start, stop)))}
    if catalogs.background is not None:
        # samples use the background at t + lead_time, so these are the times normalization sees
        matched = match_times(catalogs.state, catalogs.background, range(start + spec.lead_time, stop))
        groups["background"] = _accumulate(catalogs.background, [int(t) for t in matched])
    if catalogs.invariants is not None:
        groups["invariants"] = _accumulate(catalogs.invariants, [None])
    return Stats(_fingerprint(spec, catalogs, (start, stop)), groups)


def compute_stats(spec: DataSpec) -> Stats:
    """Compute the train-split statistics from the files (no cache)."""
    catalogs = open_catalogs(spec)
    try:
        return _compute(spec, catalogs)
    finally:
        catalogs.close()


def _read_cache(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)["entries"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"the stats cache {path} is not a physics_dp stats file ({err}); delete it to recompute") from err


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_cache(path: str, entries: dict) -> None:
    """Write-then-rename, so a concurrent reader sees the old file or the new one, never half of one.

    The file gets the mode any new file would get (0666 less the umask), not mkstemp's private 0600:
    it sits beside shared data, and other users reading that data need the statistics too.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".stats-", suffix=".tmp", dir=directory)
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump({"entries": entries}, f, indent=1)
        os.replace(tmp, path)
    except OSError as err:
        raise OSError(f"cannot write the stats cache {path} ({err}); set DataSpec.stats_file to a writable path") from err


def load_or_compute_stats(spec: DataSpec) -> Stats:
    """Statistics from the cache file if it holds this spec's fingerprint, else computed and cached."""
    catalogs = open_catalogs(spec)
    try:
        train = split_range(spec, "train", catalogs.state.n_times)
        key = _fingerprint(spec, catalogs, train)
        path = default_stats_file(spec)
        entries = _read_cache(path)
        if key in entries:
            return Stats.from_json(entries[key])
        stats = _compute(spec, catalogs)
    finally:
        catalogs.close()
    entries = _read_cache(path)  # another process may have added entries meanwhile
    entries[key] = stats.to_json()
    _write_cache(path, entries)
    return stats
