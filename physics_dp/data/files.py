"""Finding netCDF files and keeping them open, with one lock around the netCDF library.

HDF5 (under netCDF4) is usually built without thread safety, and the loader reads in a background
thread while the main thread may open, read or write other datasets (the catalogs, the forecast
writer, the source description, the synthetic writer), so every call into netCDF4 made by this
package holds ``NETCDF_LOCK``: through ``open_dataset`` for a file opened and closed in one block,
else around each use of a handle kept open (``FilePool``, ``ForecastWriter``).
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import netCDF4

# Reentrant because holders nest: a catalog holds it while its FilePool takes it again, and the
# forecast writer's abort and step count take it inside its constructor and ``write``.
NETCDF_LOCK = threading.RLock()


@contextmanager
def open_dataset(path: str | os.PathLike, mode: str = "r") -> Iterator[netCDF4.Dataset]:
    """``netCDF4.Dataset(path, mode)`` opened, used and closed while holding ``NETCDF_LOCK``."""
    with NETCDF_LOCK, netCDF4.Dataset(path, mode) as ds:
        yield ds


def resolve_paths(value: str | os.PathLike | Sequence[str | os.PathLike], what: str) -> list[str]:
    """Expand a path, a glob, or a list of either into absolute paths (sorted within each glob)."""
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    if not items:
        raise ValueError(f"{what}: the file list is empty; give a path, a glob pattern or a list of paths")
    paths: list[str] = []
    for item in items:
        text = os.fspath(item)
        if glob.has_magic(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise FileNotFoundError(
                    f"{what}: no file matches the pattern {text!r}; check the directory and the pattern "
                    "(e.g. write synthetic data with `python -m physics_dp.data.synthetic --out DIR`)"
                )
        elif os.path.isfile(text):
            matches = [text]
        else:
            raise FileNotFoundError(f"{what}: the file {text!r} does not exist; check the path")
        paths.extend(os.path.abspath(m) for m in matches)
    return list(dict.fromkeys(paths))


class FilePool:
    """Open netCDF4 handles, one per path, opened on first use (reopening per read costs milliseconds)."""

    def __init__(self) -> None:
        self._handles: dict[str, netCDF4.Dataset] = {}

    def get(self, path: str) -> netCDF4.Dataset:
        with NETCDF_LOCK:
            handle = self._handles.get(path)
            if handle is None:
                handle = netCDF4.Dataset(path, "r")
                self._handles[path] = handle
            return handle

    def close(self) -> None:
        with NETCDF_LOCK:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()
