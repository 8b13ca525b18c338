"""Every netCDF4 call of the package holds NETCDF_LOCK (HDF5 is not thread-safe and the loader reads in a
prefetch thread): the synthetic writer, the forecast writer (its abort too) and the source description."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import netCDF4
import numpy as np
import pytest

from physics_dp.data import DataSpec, write_synthetic_dataset
from physics_dp.data.cf_writer import ForecastWriter, write_forecast_netcdf
from physics_dp.data.files import NETCDF_LOCK
from physics_dp.inference.sources import describe_sources


@dataclass
class Calls:
    """The dataset accesses seen, and those made without holding the lock."""

    seen: list[str] = field(default_factory=list)
    unlocked: list[str] = field(default_factory=list)

    def check(self, what: str) -> None:
        self.seen.append(what)
        if not NETCDF_LOCK._is_owned():  # the RLock's own "held by this thread" test (threading.Condition's)
            self.unlocked.append(what)


@pytest.fixture
def calls(monkeypatch) -> Calls:
    """netCDF4.Dataset replaced by a proxy noting every open, attribute and item access, and the close; a
    record rather than an assertion, so that no ``except`` in the code under test can hide a miss (a proxy,
    not a subclass: the Cython class's ``__dealloc__`` looks attributes up on a half-destroyed subclass)."""
    record = Calls()
    dataset = netCDF4.Dataset

    class Checked:
        def __init__(self, *args, **kwargs) -> None:
            record.check("open")
            object.__setattr__(self, "_ds", dataset(*args, **kwargs))

        def __getattr__(self, name: str):
            record.check(name)
            return getattr(self._ds, name)

        def __setattr__(self, name: str, value) -> None:
            record.check(name)
            setattr(self._ds, name, value)

        def __getitem__(self, name: str):
            record.check(f"[{name!r}]")
            return self._ds[name]

        def __enter__(self) -> Checked:
            return self

        def __exit__(self, *exc_info) -> None:
            record.check("close")
            self._ds.close()

    monkeypatch.setattr(netCDF4, "Dataset", Checked)
    return record


def test_synthetic_writer_holds_the_lock(tmp_path, calls):
    write_synthetic_dataset(tmp_path, n_times=4, height=9, width=10, files_per_split=2)
    assert calls.seen.count("open") == 5 and "close" in calls.seen
    assert calls.unlocked == []


def test_forecast_writer_holds_the_lock(tmp_path, calls):
    data = {"t2m": np.full((2, 3, 4), 280.0, dtype=np.float32)}
    times = [datetime(2024, 1, 1, h) for h in (0, 6)]
    write_forecast_netcdf(tmp_path / "done.nc", data, times=times, y=np.arange(3.0), x=np.arange(4.0), units={"t2m": "K"})
    with pytest.raises(RuntimeError), ForecastWriter(
        tmp_path / "aborted.nc", ["t2m"], reference_time=times[0], units={"t2m": "K"}, y=np.arange(3.0), x=np.arange(4.0)
    ) as writer:
        writer.write(times[0], {"t2m": data["t2m"][0]})
        raise RuntimeError("stop")
    assert calls.seen.count("open") == 2 and "isopen" in calls.seen
    assert calls.unlocked == []
    assert (tmp_path / "done.nc").exists() and not (tmp_path / "aborted.nc.partial").exists()


def test_source_description_holds_the_lock(synthetic, calls):
    info = describe_sources(DataSpec(state_files=synthetic.state_glob, state_variables=synthetic.state_variables))
    assert info.units["t2m"] == "K" and calls.seen.count("open") >= 4
    assert calls.unlocked == []
