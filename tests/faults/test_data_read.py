"""A damaged compressed chunk read by a rank names the file, variable, time index and rank."""

from __future__ import annotations

from pathlib import Path

import netCDF4
import numpy as np
import pytest

from physics_dp.data import DataReadError, DataSpec, WeatherDataset
from physics_dp.testing import run_on_ranks

from ..data.ncfiles import write_nc

pytestmark = pytest.mark.timeout(120)


def _damaged_file(path: Path) -> tuple[str, list[int]]:
    """A zlib-compressed variable with one chunk per time step, bytes in the middle overwritten;
    returns the path and the time indices netCDF4 itself cannot read any more."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 16, 32)).astype("f4")
    write_nc(str(path) + ".plain", {"a": (("time", "y", "x"), values)}, {"time": np.arange(4.0), "y": np.arange(16.0), "x": np.arange(32.0)})
    with netCDF4.Dataset(str(path) + ".plain") as src, netCDF4.Dataset(path, "w") as dst:
        for name, dim in src.dimensions.items():
            dst.createDimension(name, len(dim))
        for name, var in src.variables.items():
            compressed = dict(zlib=True, chunksizes=(1, 16, 32)) if name == "a" else {}
            out = dst.createVariable(name, var.dtype, var.dimensions, **compressed)
            out.setncatts({k: var.getncattr(k) for k in var.ncattrs()})
            out[:] = var[:]
    intact = path.read_bytes()
    for fraction in (0.5, 0.6, 0.7, 0.4, 0.8):  # somewhere inside the chunk data, not the HDF5 metadata
        data = bytearray(intact)
        start = int(len(data) * fraction)
        data[start : start + 200] = b"\xff" * 200
        path.write_bytes(bytes(data))
        broken = []
        with netCDF4.Dataset(path) as ds:
            for t in range(4):
                try:
                    ds["a"][t]
                except RuntimeError:
                    broken.append(t)
        if broken:
            return str(path), broken
    pytest.fail("the damage missed every chunk")


def _read_sample(path: str, t: int) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    dataset = WeatherDataset(DataSpec(state_files=path, state_variables=["a"], lead_time=1), rows=(8 * rank, 8 * rank + 8), normalize=False)
    try:
        dataset[t] if t < len(dataset) else dataset[t - 1]  # the sample whose state (or target) is time t
    except DataReadError as error:
        return str(error)
    finally:
        dataset.close()
    return "read without error"


def test_damaged_chunk_names_file_variable_time_and_rank(tmp_path):
    path, broken = _damaged_file(tmp_path / "damaged.nc")
    t = broken[0]
    for rank, message in enumerate(run_on_ranks(2, _read_sample, path, t)):
        assert f"rank {rank} could not read state variable 'a' at time index {t}" in message, message
        assert path in message and "HDF error" in message and f"rows ({8 * rank}, {8 * rank + 8})" in message
