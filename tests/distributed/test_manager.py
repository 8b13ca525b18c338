"""DistributedManager: environment parsing, mesh shapes, single- and multi-rank lifecycles."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from physics_dp.distributed import DistributedManager, resolve_mesh_shape
from physics_dp.distributed.launch_env import detect, expand_nodelist, from_slurm, from_torchrun
from physics_dp.testing import free_port, run_on_ranks

LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
    "PHYSICS_DP_BACKEND",
)


# ----- launch environment parsing (pure functions) -----

def test_torchrun_env() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "1234"}
    layout = from_torchrun(env)
    assert (layout.rank, layout.world_size, layout.local_rank) == (3, 8, 1)
    assert (layout.master_addr, layout.master_port, layout.launcher) == ("10.0.0.2", 1234, "torchrun")


def test_slurm_env_uses_first_host_and_default_port() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "node[01-04,07],gpu3"}
    layout = from_slurm(env)
    assert (layout.rank, layout.world_size, layout.local_rank) == (5, 16, 1)
    assert (layout.master_addr, layout.master_port, layout.launcher) == ("node01", 29500, "slurm")


def test_slurm_env_respects_master_overrides_and_old_nodelist_name() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a,b", "MASTER_PORT": "4000"}
    assert (from_slurm(env).master_addr, from_slurm(env).master_port) == ("a", 4000)
    assert from_slurm({**env, "MASTER_ADDR": "head"}).master_addr == "head"


def test_detect_prefers_torchrun_and_returns_none_for_a_lone_process() -> None:
    both = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n1"}
    assert detect(both).launcher == "torchrun"
    assert detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n1"}).launcher == "slurm"
    assert detect({"PATH": "/bin"}) is None


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04,07],gpu3", ["node01", "node02", "node03", "node04", "node07", "gpu3"]),
        ("single", ["single"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("x[3],y[1-2].cluster", ["x3", "y1.cluster", "y2.cluster"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["n[1-2", "n1-2]", "n[a-b]", "", "n[1-]"])
def test_expand_nodelist_rejects_malformed(nodelist: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(nodelist)


# ----- mesh shapes -----

@pytest.mark.parametrize(
    ("shape", "world_size", "resolved"),
    [((-1,), 4, (4,)), ((2, -1), 4, (2, 2)), ((-1, 1), 3, (3, 1)), ((1, 4), 4, (1, 4)), ((1,), 1, (1,))],
)
def test_resolve_mesh_shape(shape, world_size, resolved) -> None:
    assert resolve_mesh_shape(shape, world_size) == resolved


@pytest.mark.parametrize(
    ("shape", "world_size", "match"),
    [
        ((-1, -1), 4, r"more than one -1"),
        ((0, 4), 4, r"non-positive"),
        ((2, -3), 4, r"non-positive"),
        ((3, 2), 4, r"\(3, 2\).*world size is 4"),
        ((3, -1), 4, r"\(3, -1\).*world size 4"),
        ((), 4, r"at least one"),
    ],
)
def test_resolve_mesh_shape_errors(shape, world_size, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_mesh_shape(shape, world_size)


# ----- lone process (in the test process itself) -----

@pytest.fixture
def lone_process(monkeypatch):
    """A test process with no launcher variables and no process group; cleaned up afterwards."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized() and not DistributedManager.is_initialized()
    yield
    DistributedManager().cleanup()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_lone_process_gets_a_one_rank_group(lone_process) -> None:
    DistributedManager.initialize()
    manager = DistributedManager()
    assert (manager.rank, manager.world_size, manager.local_rank) == (0, 1, 0)
    assert manager.distributed is False
    assert manager.backend == "gloo" and manager.device == torch.device("cpu")
    assert dist.is_initialized() and dist.get_world_size() == 1
    value = torch.ones(2)
    dist.all_reduce(value)
    assert torch.equal(value, torch.ones(2))


def test_singleton_shares_state_and_initialize_is_idempotent(lone_process) -> None:
    DistributedManager.initialize(timeout=30.0)
    world = dist.group.WORLD
    DistributedManager.initialize()
    assert dist.group.WORLD is world
    assert DistributedManager().__dict__ is DistributedManager().__dict__


def test_lone_process_mesh_and_errors(lone_process) -> None:
    DistributedManager.initialize()
    manager = DistributedManager()
    mesh = manager.initialize_mesh((-1,), ("domain",))
    assert tuple(mesh.shape) == (1,) and mesh.mesh_dim_names == ("domain",)
    assert manager.global_mesh is mesh
    with pytest.raises(ValueError, match=r"\(2,\).*world size is 1"):
        manager.initialize_mesh((2,), ("domain",))
    with pytest.raises(ValueError, match="mesh_dim_names"):
        manager.initialize_mesh((1, 1), ("domain",))


def test_cleanup_allows_initialize_again(lone_process) -> None:
    DistributedManager.initialize()
    DistributedManager().initialize_mesh((1,))
    DistributedManager().cleanup()
    assert not DistributedManager.is_initialized() and not dist.is_initialized()
    assert DistributedManager().global_mesh is None and DistributedManager().backend is None
    DistributedManager.initialize()
    assert DistributedManager.is_initialized() and dist.is_initialized()


def test_existing_process_group_is_adopted_and_left_alone(lone_process) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    DistributedManager.initialize()
    assert DistributedManager().backend == "gloo" and DistributedManager().world_size == 1
    DistributedManager().cleanup()
    assert dist.is_initialized()  # the user's group is the user's to destroy


@pytest.mark.filterwarnings("ignore:Device capability")
def test_backend_override_from_environment(lone_process, monkeypatch) -> None:
    monkeypatch.setenv("PHYSICS_DP_BACKEND", "no-such-backend")
    with pytest.raises(Exception, match="no-such-backend"):  # torch rejects it: proof the variable was read
        DistributedManager.initialize()
    assert not DistributedManager.is_initialized()


def test_initialize_mesh_needs_initialize(lone_process) -> None:
    with pytest.raises(RuntimeError, match="initialize"):
        DistributedManager().initialize_mesh((1,))


# ----- real ranks (through the rank pool, launched with torchrun-style variables) -----

def _layout() -> tuple:
    manager = DistributedManager()
    world = dist.group.WORLD
    DistributedManager.initialize()  # already done by the pool: must be a no-op
    assert dist.group.WORLD is world
    return manager.rank, manager.world_size, manager.local_rank, manager.distributed, manager.backend, str(manager.device)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_layout_on_real_ranks(world_size: int) -> None:
    layouts = run_on_ranks(world_size, _layout)
    assert layouts == [(r, world_size, r, True, "gloo", "cpu") for r in range(world_size)]


def _mesh_on_ranks(shape: tuple[int, ...], names: tuple[str, ...]) -> tuple:
    manager = DistributedManager()
    mesh = manager.initialize_mesh(shape, names)
    assert manager.global_mesh is mesh
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.get_group(names[-1]))
    with pytest.raises(ValueError, match=r"\(3, -1\).*world size 4"):
        manager.initialize_mesh((3, -1), names)  # raises before any communication, on every rank
    return tuple(mesh.shape), tuple(mesh.get_coordinate()), int(total.item())


def test_initialize_mesh_on_four_ranks() -> None:
    results = run_on_ranks(4, _mesh_on_ranks, (2, -1), ("data", "domain"))
    assert [r[0] for r in results] == [(2, 2)] * 4
    assert [r[1] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r[2] for r in results] == [2] * 4


def _meshes_built_twice() -> tuple:
    """Two builds of one layout share a mesh and its groups; another layout gets its own."""
    from physics_dp.distributed import build_device_mesh

    first = build_device_mesh((2, -1), ("data", "domain"))
    groups = dist.get_pg_count()
    again = DistributedManager().initialize_mesh((2, 2), ("data", "domain"))
    same = again is first and dist.get_pg_count() == groups
    other = build_device_mesh((4,), ("flat",))
    return same, other is not first, dist.get_pg_count() - groups, other is build_device_mesh((4,), ("flat",))


def test_a_layout_built_again_reuses_its_mesh_and_process_groups() -> None:
    """Each build used to create a process group per axis, never freed: a train() per test or per
    sweep point left threads, sockets and 144 MiB of /dev/shm behind each time."""
    results = run_on_ranks(4, _meshes_built_twice)
    same, distinct, new_groups, reused = results[0]
    assert results == [results[0]] * 4
    assert same and distinct and reused
    assert new_groups <= 1  # the 1-D mesh over every rank may take the default group itself


def _cleanup_and_rejoin(port: int) -> float:
    DistributedManager().cleanup()
    assert not dist.is_initialized()
    # A fresh port: peers may still be connected to the old store while rank 0 tears it down.
    os.environ["MASTER_PORT"] = str(port)
    DistributedManager.initialize(backend="gloo")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item()


def test_cleanup_and_rejoin_on_real_ranks() -> None:
    assert run_on_ranks(2, _cleanup_and_rejoin, free_port()) == [1.0, 1.0]
    assert run_on_ranks(2, _layout)[1][0] == 1  # the pool keeps working on the new group
