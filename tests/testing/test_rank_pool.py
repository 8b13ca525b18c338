"""The rank pool: results per rank, failures reported promptly with tracebacks, recovery."""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from physics_dp.distributed import DistributedManager
from physics_dp.testing import RankFailure, get_mesh, run_on_ranks

HANG_GUARD_S = 20.0  # generous: only proves nothing waited for a long default timeout


def _rank_report(offset: float) -> dict:
    value = torch.tensor([float(dist.get_rank()) + offset])
    dist.all_reduce(value)
    manager = DistributedManager()
    return {"rank": manager.rank, "world_size": manager.world_size, "sum": value}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_on_ranks(world_size, _rank_report, 0.5)
    expected_sum = sum(range(world_size)) + 0.5 * world_size
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world_size"] == world_size for r in results)
    assert all(torch.equal(r["sum"], torch.tensor([expected_sum])) for r in results)


def _echo(tensor: torch.Tensor, *, scale: int) -> torch.Tensor:
    return tensor * scale + dist.get_rank()


def test_args_kwargs_and_tensors_round_trip() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    out = run_on_ranks(2, _echo, x, scale=3)
    assert torch.equal(out[0], x * 3) and torch.equal(out[1], x * 3 + 1)


def test_warm_round_trip_is_fast() -> None:
    run_on_ranks(4, dist.get_rank)
    start = time.perf_counter()
    for _ in range(20):
        run_on_ranks(4, dist.get_rank)
    assert (time.perf_counter() - start) / 20 < 0.5  # hang guard; measured ~0.2 ms per call


def _rank1_raises_then_barrier() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 blocks here forever: its peer is gone


def test_raising_rank_is_reported_with_its_traceback() -> None:
    start = time.perf_counter()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _rank1_raises_then_barrier)
    assert time.perf_counter() - start < HANG_GUARD_S
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: rank one refuses" in message
    assert "_rank1_raises_then_barrier" in message  # the remote traceback, not just the message
    assert message.endswith("----- in short -----\nrank 1: ValueError: rank one refuses"), message[-300:]
    assert sorted(info.value.errors) == [1]
    assert info.value.stuck == [0]


def _all_raise() -> None:
    raise KeyError(f"rank {dist.get_rank()}")


def test_every_rank_raising_is_reported_without_grace_wait() -> None:
    start = time.perf_counter()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(3, _all_raise)
    assert time.perf_counter() - start < HANG_GUARD_S
    assert sorted(info.value.errors) == [0, 1, 2] and info.value.stuck == []


def _mismatched_collectives() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.broadcast(torch.ones(3), src=1)


def _missing_barrier() -> None:
    if dist.get_rank() != 1:
        dist.barrier()


@pytest.mark.parametrize("fn", [_mismatched_collectives, _missing_barrier])
def test_hang_is_reported_within_timeout(fn) -> None:
    start = time.perf_counter()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, fn, timeout=2.0)
    assert time.perf_counter() - start < HANG_GUARD_S
    assert 0 in info.value.stuck  # the broadcast root may or may not get its data out
    assert "did not finish within the timeout of 2.0 s" in str(info.value)
    if hasattr(signal, "SIGUSR1"):
        assert fn.__name__ in info.value.stacks[0]  # where the stuck rank was blocked


def test_pool_recovers_after_failure() -> None:
    with pytest.raises(RankFailure):
        run_on_ranks(2, _missing_barrier, timeout=1.0)
    assert [r["rank"] for r in run_on_ranks(2, _rank_report, 0.0)] == [0, 1]


def _rank1_exits() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def test_dead_worker_is_reported() -> None:
    start = time.perf_counter()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _rank1_exits)
    assert time.perf_counter() - start < HANG_GUARD_S
    assert "exit code 7" in info.value.errors[1]


def _rank1_crashes() -> None:
    if dist.get_rank() == 1:
        ctypes.string_at(0)  # a segmentation fault, as a crash inside a C++ kernel would be
    dist.barrier()


def test_crashed_worker_is_reported_with_its_stack() -> None:
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _rank1_crashes)
    message = info.value.errors[1]
    assert "exit code -11" in message and "Segmentation fault" in message, message
    assert "_rank1_crashes" in message  # the frame where it crashed
    gist = str(info.value).rsplit("----- in short -----", 1)[1]  # the message's last lines say it all
    assert "rank 1: worker process died (exit code -11); SIGSEGV; Fatal Python error: Segmentation fault" in gist, gist
    assert "crashing thread at" in gist and "_rank1_crashes" in gist, gist


def _rank1_aborts_after_native_words() -> None:
    if dist.get_rank() == 1:
        os.write(2, b"terminate called: the words a C++ crash leaves on stderr\n")  # no Python buffer involved
        os.abort()
    dist.barrier()


def test_native_crash_message_is_reported() -> None:
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _rank1_aborts_after_native_words)
    message = str(info.value)
    assert "rank 1 stdout and stderr during the task" in message, message
    assert "the words a C++ crash leaves on stderr" in message, message
    assert "exit code -6" in info.value.errors[1]


def _prints_and_warns() -> None:
    print(f"printed on {dist.get_rank()}")
    sys.stderr.write(f"warned on {dist.get_rank()}\n")


def test_output_of_a_task_reaches_the_caller_with_its_rank(capsys) -> None:
    run_on_ranks(2, _prints_and_warns)
    err = capsys.readouterr().err
    for rank in range(2):
        assert f"[rank {rank}] printed on {rank}\n" in err and f"[rank {rank}] warned on {rank}\n" in err, err
    run_on_ranks(2, _rank_report, 0.0)
    assert capsys.readouterr().err == ""  # passed on once, not again with the next task


def test_unpicklable_function_is_rejected_in_the_caller() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(2, lambda: None)


def test_functions_from_paths_added_after_pool_start(tmp_path, monkeypatch) -> None:
    run_on_ranks(2, dist.get_rank)  # pool already running
    (tmp_path / "late_module_for_rank_pool.py").write_text("def answer():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("late_module_for_rank_pool")
    assert run_on_ranks(2, module.answer) == [42, 42]
    sys.modules.pop("late_module_for_rank_pool")


def _mesh_facts(shape: tuple[int, ...], names: tuple[str, ...] | None) -> dict:
    mesh = get_mesh(shape, names)
    ones = torch.ones(1)
    dist.all_reduce(ones, group=mesh.get_group(mesh.ndim - 1))
    return {
        "shape": tuple(mesh.shape),
        "names": mesh.mesh_dim_names,
        "cached": get_mesh(shape, names) is mesh,
        "coordinate": tuple(mesh.get_coordinate()),
        "last_axis_size": int(ones.item()),
    }


@pytest.mark.parametrize(
    ("shape", "names", "expected_shape", "expected_names"),
    [
        ((2, 2), None, (2, 2), ("data", "domain")),
        ((4,), None, (4,), ("domain",)),
        ((1, 4), ("a", "b"), (1, 4), ("a", "b")),
        ((4, 1), ("a", "b"), (4, 1), ("a", "b")),
        ((-1, 2), None, (2, 2), ("data", "domain")),
    ],
)
def test_get_mesh_builds_and_caches(shape, names, expected_shape, expected_names) -> None:
    facts = run_on_ranks(4, _mesh_facts, shape, names)
    assert all(f["shape"] == expected_shape and f["names"] == expected_names for f in facts)
    assert all(f["cached"] for f in facts)
    assert all(f["last_axis_size"] == expected_shape[-1] for f in facts)
    coords = [f["coordinate"] for f in facts]
    assert len(set(coords)) == 4  # every rank has its own place in the mesh
