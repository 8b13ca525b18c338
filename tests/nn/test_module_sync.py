"""physics_dp.nn module sync and gradient reduction: replicas agree exactly where asked, nowhere else."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from physics_dp.distributed.collectives import count_communication
from physics_dp.nn import all_reduce_gradients, distribute_module, sync_module_over_mesh
from physics_dp.testing import get_mesh, run_on_ranks


class _Net(nn.Module):
    """Parameters and buffers of several dtypes (float32, float64, int64, bool, complex64)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.norm = nn.BatchNorm2d(3)
        self.head = nn.Linear(3, 2).double()
        self.register_buffer("mask", torch.rand(5) > 0.5)
        self.register_buffer("phase", torch.randn(4, dtype=torch.complex64))
        self.register_buffer("absent", None)


def _seeded_net(rank: int) -> _Net:
    torch.manual_seed(1000 + rank)
    net = _Net()
    net.norm(torch.randn(4, 3, 5, 5))  # running stats and num_batches_tracked now differ per rank...
    net.norm.num_batches_tracked.fill_(rank)  # ...and so does the counter
    return net


def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


def _sync_rank(mesh_shape: tuple[int, ...], axis):
    mesh = get_mesh(mesh_shape)
    rank = dist.get_rank()
    net = _seeded_net(rank)
    with count_communication() as log:
        out = sync_module_over_mesh(net, mesh, axis)
    assert out is net
    return tuple(mesh.get_coordinate()), _state(net), _state(_seeded_net(rank)), log.kinds()


def _equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "axis, synced",
    [(None, (0, 1)), ("domain", (1,)), (1, (1,)), ("data", (0,)), ([0, "domain"], (0, 1))],
    ids=["all", "domain", "axis1", "data", "both-mixed"],
)
def test_sync_2x2_makes_synced_axes_identical_and_leaves_others_alone(axis, synced):
    results = run_on_ranks(4, _sync_rank, (2, 2), axis)
    by_coord = {coord: (state, original) for coord, state, original, _ in results}
    for coord, (state, original) in by_coord.items():
        # the value a rank must end with: its original state at the coordinate with synced axes zeroed
        source = tuple(0 if a in synced else c for a, c in enumerate(coord))
        assert _equal_states(state, by_coord[source][1]), (coord, source)
    # the state really differed before, so equality above is not vacuous; unsynced axes still differ
    assert not _equal_states(by_coord[(0, 0)][1], by_coord[(1, 1)][1])
    for axis_left in {0, 1} - set(synced):
        other = (1, 0) if axis_left == 0 else (0, 1)
        assert not _equal_states(by_coord[(0, 0)][0], by_coord[other][0])
    # one layout check per synced axis, then one broadcast per dtype bucket (5 dtypes) per axis
    for coord, _, _, kinds in results:
        assert kinds.count("all_gather_sizes") == len(synced)
        sources = sum(1 for a in synced if coord[a] == 0)  # only the source records a broadcast
        assert kinds.count("broadcast") == 5 * sources


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sync_1d_mesh_matches_rank_zero(world):
    results = run_on_ranks(world, _sync_rank, (world,), None)
    first = results[0][2]
    for _, state, _, _ in results:
        assert _equal_states(state, first)


def _sync_mismatch_rank():
    mesh = get_mesh((2,))
    net = nn.Linear(3, 2 + dist.get_rank())  # ranks build different modules
    try:
        sync_module_over_mesh(net, mesh)
    except RuntimeError as error:
        return str(error)
    return None


def test_sync_mismatched_modules_raise_on_every_rank():
    for message in run_on_ranks(2, _sync_mismatch_rank):
        assert message is not None and "disagree" in message


def _sync_rejects_subclass_rank():
    from physics_dp.shard_tensor import Replicate, distribute_tensor

    mesh = get_mesh((2,))
    net = nn.Linear(2, 2)
    net.weight = nn.Parameter(distribute_tensor(torch.ones(2, 2), mesh, [Replicate()]))
    try:
        sync_module_over_mesh(net, mesh)
    except TypeError as error:
        return str(error)
    return None


def test_sync_rejects_tensor_subclass_parameters():
    for message in run_on_ranks(2, _sync_rejects_subclass_rank):
        assert message is not None and "weight" in message


def _distribute_rank():
    mesh = get_mesh((2, 2))
    net = _seeded_net(dist.get_rank())
    calls: list[str] = []

    def partition_fn(name: str, submodule: nn.Module, device_mesh) -> None:
        assert device_mesh is mesh
        assert submodule is net.get_submodule(name)
        calls.append(name)

    assert distribute_module(net, mesh, partition_fn) is net
    assert distribute_module(_seeded_net(0), mesh) is not None  # partition_fn is optional
    return calls, [name for name, _ in net.named_modules()], _state(net)


def test_distribute_module_syncs_and_calls_partition_fn_for_every_submodule():
    results = run_on_ranks(4, _distribute_rank)
    for calls, names, state in results:
        assert calls == names == ["", "conv", "norm", "head"]
        assert _equal_states(state, results[0][2])
        for value in state.values():
            assert not isinstance(value, torch.distributed.tensor.DTensor)  # parameters stay plain


def _integer_grads(net: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Integer-valued gradients, so a sum in any order is exact and comparable with torch.equal."""
    gen = torch.Generator().manual_seed(rank)
    return {
        name: torch.randint(-50, 50, p.shape, generator=gen).to(p.dtype)
        for name, p in net.named_parameters()
        if name != "norm.bias"  # one parameter without a gradient: must be skipped, not zeroed
    }


def _grads_rank(mesh_shape: tuple[int, ...], axes, average: bool, check: bool):
    mesh = get_mesh(mesh_shape)
    rank = dist.get_rank()
    net = _seeded_net(0)
    for name, p in net.named_parameters():
        p.grad = _integer_grads(net, rank).get(name)
    with count_communication() as log:
        assert all_reduce_gradients(net, mesh, axes, average=average, check=check) is net
    grads = {name: p.grad for name, p in net.named_parameters()}
    return rank, mesh.mesh.tolist(), tuple(mesh.get_coordinate()), grads, log.kinds()


@pytest.mark.parametrize(
    "mesh_shape, axes, reduced",
    [((2, 2), "data", (0,)), ((2, 2), ["domain"], (1,)), ((2, 2), ("data", "domain"), (0, 1)), ((3,), 0, (0,))],
    ids=["2x2-data", "2x2-domain", "2x2-both", "3-domain"],
)
@pytest.mark.parametrize("average", [False, True], ids=["sum", "avg"])
def test_all_reduce_gradients_matches_manual_sum_with_one_collective_per_dtype(mesh_shape, axes, reduced, average):
    results = run_on_ranks(math.prod(mesh_shape), _grads_rank, mesh_shape, axes, average, False)
    template = _seeded_net(0)
    ranks = torch.tensor(results[0][1])
    for rank, _, coord, grads, kinds in results:
        index = tuple(slice(None) if a in reduced else c for a, c in enumerate(coord))
        peers = ranks[index].reshape(-1).tolist()
        contributions = [_integer_grads(template, peer) for peer in peers]
        for name, grad in grads.items():
            if name == "norm.bias":
                assert grad is None
                continue
            expected = sum(c[name] for c in contributions)
            if average:
                expected = expected / len(peers)
            assert torch.equal(grad, expected), (rank, name)
        assert kinds == ["all_reduce", "all_reduce"]  # float32 and float64 buckets, one collective each


def test_all_reduce_gradients_check_passes_on_matching_modules():
    for _, _, _, _, kinds in run_on_ranks(2, _grads_rank, (2,), "domain", False, True):
        assert kinds == ["all_gather_sizes", "all_reduce", "all_reduce"]


def _grads_mismatch_rank():
    mesh = get_mesh((2,))
    net = nn.Linear(3, 2)
    net.weight.grad = torch.ones_like(net.weight)
    if dist.get_rank() == 1:
        net.bias.grad = torch.ones_like(net.bias)  # only rank 1 has a bias gradient
    try:
        all_reduce_gradients(net, mesh, 0, check=True)
    except RuntimeError as error:
        return str(error)
    return None


def test_all_reduce_gradients_check_raises_on_every_rank_for_mismatched_grads():
    for message in run_on_ranks(2, _grads_mismatch_rank):
        assert message is not None and "disagree" in message


def _bad_axis_rank():
    mesh = get_mesh((2,))
    errors = []
    for axes in ["nope", 3, 1.5]:
        try:
            all_reduce_gradients(nn.Linear(1, 1), mesh, axes)
        except (ValueError, TypeError) as error:
            errors.append(type(error).__name__)
    return errors


def test_bad_axes_raise_clear_errors():
    assert run_on_ranks(2, _bad_axis_rank) == [["ValueError", "ValueError", "TypeError"]] * 2
