"""The shared-memory host channel: same answers as gloo, bitwise equal on every rank, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from physics_dp.testing import run_on_ranks


def _results_against_gloo() -> dict:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    values = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    out = {}
    for op, gloo_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        expected = values.clone()
        dist.all_reduce(expected, op=gloo_op, group=group)
        out[op] = (collectives.all_reduce(values, op, group), expected)
    out["avg"] = (collectives.all_reduce(values, "avg", group), out["sum"][1] / world)
    ints = torch.arange(4, dtype=torch.int64) * (rank + 1)
    out["int sum"] = (collectives.all_reduce(ints, "sum", group), torch.arange(4) * sum(range(1, world + 1)))
    out["int32 max"] = (collectives.all_reduce(ints.int(), "max", group), torch.arange(4, dtype=torch.int32) * world)
    out["empty"] = (collectives.all_reduce(torch.zeros(0, 3), "sum", group), torch.zeros(0, 3))  # every rank still calls
    sizes = [r + 1 for r in range(world)]  # uneven pieces, one row per rank more
    piece = torch.full((rank + 1, 2), float(rank), dtype=torch.float32)
    expected_gather = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(world)])
    out["gather"] = (collectives.all_gather_along_dim(piece, sizes, 0, group), expected_gather)
    out["sizes"] = (torch.tensor(collectives.gather_sizes([rank, 7], group)), torch.tensor([[r, 7] for r in range(world)]))
    channel = host_channel._channels.get(group)
    return {"pairs": out, "calls": None if channel is None else channel._calls, "sum bits": out["sum"][0]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_gloo_and_agree_bitwise_across_ranks(world):
    results = run_on_ranks(world, _results_against_gloo)
    for result in results:
        assert result["calls"] is not None and result["calls"] >= 7  # the channel carried them
        for name, (actual, expected) in result["pairs"].items():
            torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=1e-12, atol=1e-12, msg=name)
        assert result["pairs"]["int32 max"][0].dtype == torch.int32  # reduced in its own dtype, not widened
    for result in results[1:]:
        assert torch.equal(result["sum bits"], results[0]["sum bits"])


def _all_to_all_in_rounds(dtype: torch.dtype) -> dict:
    """Pieces of several MiB, uneven per pair, strided on both ends, some empty, rows over a slot."""
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    row = host_channel.SLOT_BYTES // 8 // world + 5  # one row of dim 1 fills more than a peer's region

    def piece(sender: int, receiver: int) -> torch.Tensor:
        rows = 0 if (sender, receiver) == (1, 0) else 3 + sender + 2 * receiver
        gen = torch.Generator().manual_seed(100 * sender + receiver)
        full = torch.randn(rows, row, 3, generator=gen).to(dtype)
        return full.transpose(0, 1)  # (row, rows, 3), strided

    sends = [piece(rank, peer) for peer in range(world)]
    expected = [piece(peer, rank) for peer in range(world)]
    shapes = [e.shape for e in expected]
    joined = collectives.all_to_all_joined(sends, shapes, 1, group)
    channel = host_channel._channels[group]
    calls_before = channel._calls
    with collectives.count_communication() as log:
        chunks = collectives.all_to_all_chunks(sends, shapes, group)
    return {
        "joined": (joined, torch.cat(expected, dim=1)),
        "chunks": (torch.cat(chunks, dim=1), torch.cat(expected, dim=1)),
        "rounds": channel._calls - calls_before,
        "bytes": (log.bytes_sent, sum(s.numel() * s.element_size() for p, s in enumerate(sends) if p != rank)),
    }


@pytest.mark.parametrize("world, dtype", [(2, torch.float32), (3, torch.complex64), (4, torch.float64)])
def test_all_to_all_of_many_slots_runs_in_rounds_and_matches(world, dtype):
    for result in run_on_ranks(world, _all_to_all_in_rounds, dtype):
        assert result["rounds"] > 2  # several rounds through the slots, not gloo
        for name in ("joined", "chunks"):
            assert torch.equal(*result[name]), name
        assert result["bytes"][0] == result["bytes"][1]


def _ops_of_an_all_to_all_and_a_message() -> dict:
    """The aten ops the channel itself runs: an all-to-all of several rounds, and one message each way."""
    from collections import Counter

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from physics_dp.distributed import collectives, host_channel

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    group = dist.group.WORLD
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    collectives.all_reduce(torch.ones(1), "sum", group)  # opens the channel
    channel = host_channel._channels[group]
    rows = host_channel.SLOT_BYTES // 4 // 64  # 64-float rows: a peer's piece takes about 2.5 slots
    sends = [torch.full((rows * 5 // 2, 64), float(rank)) for _ in range(2)]
    outs = [torch.empty_like(piece) for piece in sends]
    for _ in range(2):  # the banks' typed views and the blocks' views are made once, on first use (both banks)
        channel.all_to_all(sends, outs)
    before = channel._calls
    with CountOps() as all_to_all:
        channel.all_to_all(sends, outs)
    rounds = channel._calls - before
    message = torch.arange(6.0).view(2, 3) + rank
    for _ in range(2):  # likewise the mailboxes' views
        channel.send(peer, message)
        channel.receive(peer, channel.post_receive(peer), (2, 3), torch.float32)
    with CountOps() as messages:
        number = channel.post_receive(peer)
        channel.send(peer, message)
        received = channel.receive(peer, number, (2, 3), torch.float32)
    return {
        "rounds": rounds, "all_to_all": dict(all_to_all.ops), "messages": dict(messages.ops),
        "moved": torch.equal(outs[peer], torch.full_like(outs[peer], float(peer))),
        "received": torch.equal(received, torch.arange(6.0).view(2, 3) + peer),
    }


def test_the_channel_runs_two_tensor_ops_per_peer_and_round():
    """A round writes a block into the slot and reads one out: a copy each, through views of the
    slots made on first use, with the "more rounds follow" flags in the counters (no tensor op); a
    message is likewise a copy at each end."""
    for result in run_on_ranks(2, _ops_of_an_all_to_all_and_a_message):
        assert result["moved"] and result["received"]
        rounds, ops = result["rounds"], result["all_to_all"]
        assert rounds == 3
        assert ops.pop("aten.copy_") == 1 + 2 * rounds  # the kept piece, then one block in and one out per round
        assert set(ops) <= {"aten.slice", "aten.select"}, ops  # the blocks' views of the pieces, made once per call
        assert result["messages"] == {"aten.copy_": 1, "aten.clone": 1}


def test_a_block_view_stays_inside_its_slot():
    """The slot views are ``as_strided`` (unchecked against the slot's end): a block that would
    spill into the next slot raises instead."""
    from physics_dp.distributed import host_channel

    slots = torch.zeros(2, 16)
    host_channel._block_view(slots, 1, 8, (2, 4)).fill_(1.0)  # the last 8 elements of slot 1
    assert slots[1, 8:].eq(1).all() and slots[1, :8].eq(0).all() and slots[0].eq(0).all()
    with pytest.raises(RuntimeError, match="overruns a slot of 16 elements"):
        host_channel._block_view(slots, 0, 8, (3, 4))


def _large_all_reduce_in_rounds() -> dict:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    group = dist.group.WORLD
    rank = dist.get_rank()
    collectives.all_reduce(torch.ones(1), "sum", group)
    channel = host_channel._channels[group]
    before = channel._calls
    count = 2 * host_channel.SLOT_BYTES // 8 + 3  # two slots of float64 and a partial third
    values = torch.randn(count, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    results = {op: collectives.all_reduce(values.view(-1, 1), op, group) for op in ("sum", "max")}
    expected = {}
    for op, gloo_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        expected[op] = values.clone().view(-1, 1)
        dist.all_reduce(expected[op], op=gloo_op, group=group)
    return {"rounds": channel._calls - before, "results": results, "expected": expected}


def test_all_reduce_over_several_slots_runs_in_rounds():
    results = run_on_ranks(2, _large_all_reduce_in_rounds)
    for result in results:
        assert result["rounds"] == 6  # 3 rounds per all-reduce
        for op in ("sum", "max"):
            torch.testing.assert_close(result["results"][op], result["expected"][op], rtol=1e-12, atol=1e-12)
    assert torch.equal(results[0]["results"]["sum"], results[1]["results"]["sum"])


def _disabled_by_environment() -> tuple[bool, float]:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    os.environ[host_channel.ENABLE_ENV_VAR] = "0"
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        total = collectives.all_reduce(torch.ones(2), "sum", group)
        return host_channel._channels[group] is None, total[0].item()
    finally:
        del os.environ[host_channel.ENABLE_ENV_VAR]


def test_environment_variable_turns_the_channel_off():
    assert run_on_ranks(2, _disabled_by_environment) == [(True, 2.0)] * 2


def _waits_for_a_late_peer() -> float:
    import time

    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    collectives.all_reduce(torch.ones(1), "sum", dist.group.WORLD)  # the channel is open, the ranks met
    before = host_channel.seconds_waited()
    if dist.get_rank() == 1:
        time.sleep(0.3)
    collectives.all_reduce(torch.ones(1), "sum", dist.group.WORLD)
    return host_channel.seconds_waited() - before


def test_the_time_a_rank_waits_for_a_late_peer_is_counted():
    early, late = run_on_ranks(2, _waits_for_a_late_peer)
    assert early >= 0.2  # rank 0 waited for the sleeping rank 1 ...
    assert late < early  # ... which found rank 0 already there


def _one_rank_waits_alone() -> str:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    group = dist.new_group([0, 1])  # a group of its own: the unmatched call leaves it out of step
    collectives.all_reduce(torch.ones(1), "sum", group)
    if dist.get_rank() == 1:
        return ""
    host_channel._channels[group]._timeout_s = 1.0
    with pytest.raises(RuntimeError) as error:
        collectives.all_reduce(torch.ones(1), "sum", group)
    return str(error.value)


def test_a_collective_no_peer_joins_raises_instead_of_hanging():
    message = run_on_ranks(2, _one_rank_waits_alone, timeout=30.0)[0]
    assert "Timed out waiting 1000ms" in message and "same collectives in the same order" in message


def test_liveness_check_tells_running_exited_and_zombie_processes_apart():
    from physics_dp.distributed.host_channel import _process_alive

    assert _process_alive(os.getpid())
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    assert not _process_alive(reaped.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    assert not _process_alive(zombie.pid)
    zombie.wait()


def _segments_left() -> list[str]:
    import torch.distributed as dist

    from physics_dp.distributed import collectives

    group = dist.new_group([0, 1])
    collectives.all_reduce(torch.ones(1), "sum", group)
    dist.barrier()
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith("physics_dp-"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_no_segment_is_left_in_dev_shm():
    assert run_on_ranks(2, _segments_left) == [[], []]


def _ring_messages() -> dict:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel
    from physics_dp.testing import get_mesh

    group = get_mesh((dist.get_world_size(),)).get_group(0)  # building the mesh opened its channel
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    channel = host_channel._channels[group]
    before = list(channel._sent)
    checks = []
    for dtype in (torch.float32, torch.float64, torch.complex64, torch.int64):
        base = (torch.arange(4 * 6 * 5) + 1000 * rank).view(4, 6, 5).to(dtype)
        piece = base[:, 1:3]  # not contiguous: copied straight into the slot
        got = collectives.exchange_with_neighbours({nxt: piece}, {prv: (4, 2, 5)}, group, dtype=dtype, device=piece.device)
        expected = (torch.arange(4 * 6 * 5) + 1000 * prv).view(4, 6, 5).to(dtype)[:, 1:3]
        checks.append(torch.equal(got[prv], expected))
    # two exchanges in flight before either is waited on (as the attention ring does)
    first = collectives.start_exchange({nxt: torch.full((3,), float(rank))}, {prv: (3,)}, group, dtype=torch.float32, device=torch.device("cpu"))
    second = collectives.start_exchange({nxt: torch.full((3,), rank + 0.5)}, {prv: (3,)}, group, dtype=torch.float32, device=torch.device("cpu"))
    checks.append(torch.equal(first.wait()[prv], torch.full((3,), float(prv))))
    checks.append(torch.equal(second.wait()[prv], torch.full((3,), prv + 0.5)))
    through_channel = [a - b for a, b in zip(channel._sent, before)]
    big = torch.full((channel.message_bytes // 8 + 1,), float(rank), dtype=torch.float64)
    got = collectives.exchange_with_neighbours({nxt: big}, {prv: big.shape}, group, dtype=big.dtype, device=big.device)
    checks.append(torch.equal(got[prv], torch.full_like(big, float(prv))))
    return {
        "checks": checks, "through channel": through_channel[nxt], "after big": channel._sent[nxt] - before[nxt],
        "message bytes": channel.message_bytes,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_point_to_point_messages_go_through_the_channel_up_to_its_slot(world):
    for result in run_on_ranks(world, _ring_messages):
        assert all(result["checks"]), result["checks"]
        assert result["through channel"] == 6  # four dtypes, two in flight together
        assert result["after big"] == 6  # the message over a slot went over gloo
        # the group's share of 32 MiB (4 MiB between 2 ranks, 1.8 MiB among 3) where /dev/shm has room
        assert result["message bytes"] in ({2: 4 * 2**20, 3: 455 * 4096}[world], 512 * 2**10)


def _message_slots_by_room(free_bytes: int) -> int:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    saved = host_channel._shm_free_bytes
    host_channel._shm_free_bytes = lambda: free_bytes
    try:
        group = dist.new_group([0, 1])
        collectives.all_reduce(torch.ones(1), "sum", group)  # opens the group's channel
        return host_channel._channels[group].message_bytes
    finally:
        host_channel._shm_free_bytes = saved


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_large_message_slots_only_where_dev_shm_has_room():
    """Docker's default /dev/shm (64 MB) keeps the small slots, leaving room for data loaders."""
    assert run_on_ranks(2, _message_slots_by_room, 64 * 2**20) == [512 * 2**10] * 2
    assert run_on_ranks(2, _message_slots_by_room, 2**40) == [4 * 2**20] * 2


def _destroyed_group_is_released() -> tuple[bool, bool]:
    import gc
    import weakref

    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    group = dist.new_group(list(range(dist.get_world_size())))
    collectives.all_reduce(torch.ones(2), "sum", group)
    opened = host_channel._channels.get(group) is not None
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return opened, alive() is None


def test_a_channel_does_not_keep_its_destroyed_group_alive():
    """A group kept alive until interpreter exit aborted gloo ranks there (a joinable worker thread)."""
    for opened, released in run_on_ranks(2, _destroyed_group_is_released):
        assert opened and released


def _collectives_first_in_inference_mode() -> dict:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    group = dist.new_group(list(range(dist.get_world_size())))  # its channel opens in inference mode below
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def run_all() -> list[torch.Tensor]:
        mine = torch.full((3,), float(rank + 1))
        received = collectives.exchange_with_neighbours(
            {nxt: mine}, {prv: mine.shape}, group, dtype=mine.dtype, device=mine.device
        )
        return [
            collectives.all_reduce(mine, "sum", group),
            collectives.all_gather_rows(mine.double(), group),
            received[prv],
        ]

    with torch.inference_mode():
        inside = run_all()
    outside = run_all()  # the channel's cached slot views must take in-place writes here too
    through_channel = host_channel._channels[group] is not None
    dist.destroy_process_group(group)
    return {"through channel": through_channel, "equal": [torch.equal(a, b) for a, b in zip(inside, outside)],
            "sum": outside[0][0].item(), "from previous": outside[2][0].item()}


@pytest.mark.parametrize("world", [2, 3])
def test_a_channel_opened_in_inference_mode_serves_training_afterwards(world):
    """Evaluating under ``torch.inference_mode()`` before training made the slots inference tensors, which
    refuse the next in-place write outside that mode ("Inplace update to inference tensor")."""
    for rank, result in enumerate(run_on_ranks(world, _collectives_first_in_inference_mode)):
        assert result["through channel"]
        assert result["equal"] == [True, True, True]
        assert result["sum"] == world * (world + 1) / 2
        assert result["from previous"] == (rank - 1) % world + 1


def _messages_of_changing_shapes() -> tuple[bool, int]:
    import torch.distributed as dist

    from physics_dp.distributed import collectives, host_channel

    group = dist.group.WORLD
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    collectives.all_reduce(torch.ones(1), "sum", group)  # opens the channel
    channel = host_channel._channels[group]
    limit, host_channel._MAX_CACHED_VIEWS = host_channel._MAX_CACHED_VIEWS, 4
    try:
        right, most = True, 0
        for rows in range(1, 9):
            number = channel.post_receive(peer)
            channel.send(peer, torch.full((rows, 3), float(rank + rows)))
            right &= torch.equal(channel.receive(peer, number, (rows, 3), torch.float32), torch.full((rows, 3), float(peer + rows)))
            most = max(most, len(channel._views))
        return right, most
    finally:
        host_channel._MAX_CACHED_VIEWS = limit
        channel._views.clear()


def test_cached_slot_views_stay_bounded_when_shapes_keep_changing():
    """Each message shape gets its slot view once; shapes that keep changing (inference at many
    sizes) empty the cache at its bound instead of growing it for good."""
    assert run_on_ranks(2, _messages_of_changing_shapes) == [(True, 4), (True, 4)]
