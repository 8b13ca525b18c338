"""Shared data fixtures: one small synthetic dataset and the hand-written 73 x 144 file set per session."""

from __future__ import annotations

import pytest

from physics_dp.data import DataSpec, SyntheticPaths, write_synthetic_dataset

from .ncfiles import World, write_world


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory) -> SyntheticPaths:
    return write_synthetic_dataset(tmp_path_factory.mktemp("synthetic"), n_times=12, height=21, width=30, files_per_split=3)


@pytest.fixture(scope="session")
def synthetic_spec(synthetic: SyntheticPaths, tmp_path_factory) -> DataSpec:
    """Every group present; stats cached in a session directory (tests of the cache use their own file)."""
    tmp_path = tmp_path_factory.mktemp("synthetic_stats")
    return DataSpec(
        state_files=synthetic.state_glob,
        state_variables=synthetic.state_variables,
        background_files=synthetic.background_glob,
        background_variables=synthetic.background_variables,
        invariant_file=synthetic.invariant_file,
        invariant_variables=synthetic.invariant_variables,
        train_times=(0, 8),
        valid_times=(8, 12),
        stats_file=str(tmp_path / "stats.json"),
    )


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> World:
    return write_world(str(tmp_path_factory.mktemp("world")))


@pytest.fixture(scope="session")
def world_spec(world: World, tmp_path_factory) -> DataSpec:
    tmp_path = tmp_path_factory.mktemp("world_stats")
    return DataSpec(
        state_files=world.state_files,
        state_variables=["u", "v", "t", "q"],
        background_files=world.background_file,
        background_variables=["bu", "bt"],
        invariant_file=world.invariant_file,
        invariant_variables=["z", "lsm"],
        level=1,
        lead_time=2,
        stats_file=str(tmp_path / "stats.json"),
    )
