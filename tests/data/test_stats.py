"""Normalization statistics: streaming equals a direct computation, the cache is keyed and reused."""

from __future__ import annotations

import dataclasses
import glob
import json

import netCDF4
import numpy as np
import pytest

from physics_dp.data import WeatherDataset, compute_stats, load_or_compute_stats

from .ncfiles import LAT, LON, N_LAT, N_LON, write_nc


def _load(pattern: str, name: str) -> np.ndarray:
    """The whole variable over all files, missing points as NaN (the direct way the streaming avoids)."""
    parts = []
    for path in sorted(glob.glob(pattern)):
        with netCDF4.Dataset(path) as ds:
            parts.append(np.ma.filled(ds[name][:].astype(np.float64), np.nan).reshape(ds[name].shape[0], -1))
    return np.concatenate(parts)


def test_streaming_stats_equal_direct_computation(synthetic, synthetic_spec):
    stats = compute_stats(synthetic_spec)
    start, stop = synthetic_spec.train_times
    state = stats.groups["state"]
    assert state.names == tuple(synthetic.state_variables)
    for k, name in enumerate(synthetic.state_variables):
        values = _load(synthetic.state_glob, name)[start:stop]
        assert state.count[k] == np.isfinite(values).sum()
        np.testing.assert_allclose(state.mean[k], np.nanmean(values), rtol=1e-12)
        np.testing.assert_allclose(state.std[k], np.nanstd(values), rtol=1e-10)
    assert state.count[2] < state.count[0]  # t2m's missing box is left out
    background = stats.groups["background"]
    for k, name in enumerate(synthetic.background_variables):
        values = _load(synthetic.background_glob, name)[start + synthetic_spec.lead_time : stop]  # as samples use it
        np.testing.assert_allclose(background.mean[k], values.mean(), rtol=1e-12)
        np.testing.assert_allclose(background.std[k], values.std(), rtol=1e-10)
    with netCDF4.Dataset(synthetic.invariant_file) as ds:
        orography = ds["orography"][:].astype(np.float64)
    np.testing.assert_allclose(stats.groups["invariants"].mean[0], orography.mean(), rtol=1e-12)


def test_normalized_train_state_has_zero_mean_unit_std(synthetic_spec):
    spec = dataclasses.replace(synthetic_spec, lead_time=1, train_times=(0, 12))
    ds = WeatherDataset(spec, stats=compute_stats(spec))
    first = ds[0]["state"].numpy()  # time 0 (no missing points), then the targets cover times 1..11
    targets = [ds[i] for i in range(len(ds))]
    for k in range(3):
        values = np.concatenate([first[k].ravel()] + [s["target"][k].numpy()[s["mask"][k].numpy()] for s in targets])
        assert abs(values.mean()) < 1e-5 and abs(values.std() - 1) < 1e-5
    ds.close()


def test_constant_channel_gets_unit_std(world, world_spec, tmp_path):
    constant = write_nc(str(tmp_path / "flat.nc"), {"flat": (("lat", "lon"), np.full((N_LAT, N_LON), 7.0))}, {"lat": LAT, "lon": LON})
    spec = dataclasses.replace(world_spec, state_variables=["u"], invariant_file=constant, invariant_variables=["flat"])
    ds = WeatherDataset(spec, stats=compute_stats(spec))
    assert ds.stats.groups["invariants"].std[0] == 1.0
    assert (ds[0]["invariants"] == 0).all()
    ds.close()


def test_cache_is_written_reused_and_keyed_by_the_spec(synthetic_spec, tmp_path):
    spec = dataclasses.replace(synthetic_spec, stats_file=str(tmp_path / "cache.json"))
    first = load_or_compute_stats(spec)
    with open(spec.stats_file) as f:
        entries = json.load(f)["entries"]
    assert list(entries) == [first.fingerprint]
    # plant a marker in the cached entry: a reuse returns it, a recomputation would not
    entries[first.fingerprint]["groups"]["state"]["mean"][0] = 12345.0
    with open(spec.stats_file, "w") as f:
        json.dump({"entries": entries}, f)
    assert load_or_compute_stats(spec).groups["state"].mean[0] == 12345.0
    other = load_or_compute_stats(dataclasses.replace(spec, train_times=(0, 6)))
    assert other.fingerprint != first.fingerprint and other.groups["state"].mean[0] != 12345.0
    with open(spec.stats_file) as f:
        assert set(json.load(f)["entries"]) == {first.fingerprint, other.fingerprint}
    assert load_or_compute_stats(dataclasses.replace(spec, lead_time=2)).fingerprint not in (first.fingerprint, other.fingerprint)


def test_default_cache_file_sits_beside_the_first_state_file(world, world_spec, tmp_path):
    spec = dataclasses.replace(world_spec, stats_file=None, state_variables=["v"], background_variables=(), invariant_variables=())
    stats = load_or_compute_stats(spec)
    with open(f"{world.root}/physics_dp_stats.json") as f:
        assert stats.fingerprint in json.load(f)["entries"]


def test_cache_problems_name_the_file(synthetic_spec, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a physics_dp stats file .* delete it to recompute"):
        load_or_compute_stats(dataclasses.replace(synthetic_spec, stats_file=str(bad)))
    with pytest.raises(OSError, match="cannot write the stats cache .* set DataSpec.stats_file to a writable path"):
        load_or_compute_stats(dataclasses.replace(synthetic_spec, stats_file=str(tmp_path / "missing_dir" / "s.json")))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_cache_file_mode_follows_the_umask(synthetic_spec, tmp_path, umask):
    """Other users reading the same data need the cache beside it (mkstemp alone gives 0600)."""
    import os
    import stat

    spec = dataclasses.replace(synthetic_spec, stats_file=str(tmp_path / f"cache-{umask:o}.json"))
    previous = os.umask(umask)
    try:
        load_or_compute_stats(spec)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(spec.stats_file).st_mode) == 0o666 & ~umask
