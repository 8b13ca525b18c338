"""Exact round trips: from_local / full_tensor / scatter_tensor and every redistribute pair."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Replicate, Shard, ShardTensor, distribute_tensor, scatter_tensor
from physics_dp.testing import get_mesh, run_on_ranks

from ._cases import MESHES, SHAPES, expected_local, global_tensor, placement_combos, world_of


def _from_expected(g, mesh, placements):
    local = expected_local(g, mesh, placements, mesh.get_coordinate())
    return ShardTensor.from_local(local, mesh, placements)


def _every_pair(mesh_shape, shape):
    mesh = get_mesh(mesh_shape)
    g = global_tensor(shape)
    coordinate = mesh.get_coordinate()
    combos = placement_combos(mesh.ndim, len(shape))
    checked = 0
    for src in combos:
        x = _from_expected(g, mesh, src)
        assert x.shape == g.shape and x.stride() == g.stride() and x.dtype == g.dtype
        assert torch.equal(x.full_tensor(), g), f"full_tensor of {src}"
        for dst in combos:
            y = x.redistribute(placements=dst)
            assert y.placements == tuple(dst)
            assert torch.equal(y.full_tensor(), g), f"{src} -> {dst}: full_tensor"
            if not any(p.is_partial() for p in dst):
                want = expected_local(g, mesh, dst, coordinate)
                assert torch.equal(y.to_local(), want), f"{src} -> {dst}: local slab"
            checked += 1
    return checked


@pytest.mark.parametrize("shape_kind", sorted(SHAPES))
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_every_redistribute_pair_round_trips(mesh_shape, shape_kind):
    counts = run_on_ranks(world_of(mesh_shape), _every_pair, mesh_shape, SHAPES[shape_kind])
    assert counts[0] > 0


def _expected_offsets(shape, mesh, placements):
    offsets = [0] * len(shape)
    for axis, placement in enumerate(placements):
        pieces = torch.tensor_split(torch.arange(shape[placement.dim]), mesh.size(axis))
        offsets[placement.dim] = sum(len(p) for p in pieces[: mesh.get_coordinate()[axis]])
    return tuple(offsets)


def _from_local_modes(mesh_shape, shape):
    mesh = get_mesh(mesh_shape)
    g = global_tensor(shape)
    placements = [Shard(0)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    local = expected_local(g, mesh, placements, mesh.get_coordinate())
    inferred = ShardTensor.from_local(local, mesh, placements, sharding_shapes="infer")
    chunked = ShardTensor.from_local(local, mesh, placements, sharding_shapes="chunk", global_shape=shape)
    explicit = ShardTensor.from_local(local, mesh, placements, sharding_shapes=inferred._spec.sharding_shapes())
    for st in (inferred, chunked, explicit):
        assert st._spec == inferred._spec
        assert torch.equal(st.full_tensor(), g)
        assert st.offsets() == _expected_offsets(shape, mesh, placements)
    return True


@pytest.mark.parametrize("shape_kind", sorted(SHAPES))
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_from_local_infer_chunk_and_explicit_agree(mesh_shape, shape_kind):
    run_on_ranks(world_of(mesh_shape), _from_local_modes, mesh_shape, SHAPES[shape_kind])


def _custom_split(world):
    mesh = get_mesh((world,))
    g = global_tensor((9, 4))
    sizes = [9] + [0] * (world - 1) if world > 1 else [9]
    sizes = sizes[::-1]  # everything on the last rank, empty shards before it
    rank = dist.get_rank()
    offset = sum(sizes[:rank])
    local = g[offset : offset + sizes[rank]]
    x = ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes={0: [(s, 4) for s in sizes]})
    assert x._spec.axis_sizes[0] == tuple(sizes)
    assert torch.equal(x.full_tensor(), g)
    y = x.redistribute(placements=[Shard(0)])  # keeps the explicit split
    assert y._spec.axis_sizes[0] == tuple(sizes)
    balanced_sizes = [len(piece) for piece in torch.tensor_split(torch.arange(9), world)]
    balanced = x.redistribute(placements=[Shard(0)], sharding_sizes={0: balanced_sizes})
    assert torch.equal(balanced.to_local(), torch.tensor_split(g, world)[rank])
    back = balanced.redistribute(placements=[Shard(1)]).redistribute(placements=[Shard(0)], sharding_sizes={0: sizes})
    assert torch.equal(back.to_local(), local)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_explicit_uneven_split_is_preserved_and_moved(world):
    run_on_ranks(world, _custom_split, world)


def _scatter(mesh_shape, shape, src):
    mesh = get_mesh(mesh_shape)
    g = global_tensor(shape, seed=3)
    placements = [Shard(0)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    rank = dist.get_rank()
    with count_communication() as log:
        x = scatter_tensor(g if rank == src else None, src, mesh, placements)
    want = expected_local(g, mesh, placements, mesh.get_coordinate())
    assert torch.equal(x.to_local(), want)
    assert torch.equal(x.full_tensor(), g)
    p2p = sum(r.bytes_sent for r in log.records if r.kind == "p2p")
    return rank, p2p, want.numel() * 4


@pytest.mark.parametrize("shape_kind", sorted(SHAPES))
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_scatter_tensor_sends_each_rank_only_its_slab(mesh_shape, shape_kind):
    world = world_of(mesh_shape)
    src = world - 1
    results = run_on_ranks(world, _scatter, mesh_shape, SHAPES[shape_kind], src)
    slab_bytes = {rank: nbytes for rank, _, nbytes in results}
    sent = {rank: p2p for rank, p2p, _ in results}
    assert sent[src] == sum(b for r, b in slab_bytes.items() if r != src)
    assert all(sent[r] == 0 for r in sent if r != src)


def _scatter_replicate_axis():
    mesh = get_mesh((2, 2))
    g = global_tensor((5, 3), seed=4)
    x = scatter_tensor(g if dist.get_rank() == 0 else None, 0, mesh, [Replicate(), Shard(0)])
    assert torch.equal(x.to_local(), torch.tensor_split(g, 2)[mesh.get_coordinate()[1]])
    return True


def test_scatter_tensor_with_a_replicated_axis():
    run_on_ranks(4, _scatter_replicate_axis)


def _shard_to_shard_is_one_all_to_all(world):
    mesh = get_mesh((world,))
    g = global_tensor((7, 6))
    x = _from_expected(g, mesh, [Shard(0)])
    with count_communication() as log:
        y = x.redistribute(placements=[Shard(1)])
    assert torch.equal(y.full_tensor(), g)
    return log.kinds()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_to_shard_uses_a_single_all_to_all(world):
    kinds = run_on_ranks(world, _shard_to_shard_is_one_all_to_all, world)
    assert all(k == ["all_to_all"] for k in kinds)


def _disagreeing_explicit_shapes(case: str) -> str:
    mesh = get_mesh((2,))
    rank = dist.get_rank()
    if case == "dicts differ":  # each rank's dict matches its own slab, but they disagree
        sizes = [3, 1] if rank == 0 else [2, 2]
    else:  # same dict everywhere, but rank 1's slab is not the size it says
        sizes = [3, 1]
    local = torch.zeros(sizes[rank] + (1 if case == "slab differs" and rank == 1 else 0), 4)
    try:
        ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes={0: [(s, 4) for s in sizes]})
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("case, needle", [("dicts differ", "differ between ranks"), ("slab differs", "the slabs have [3, 2]")])
def test_explicit_sharding_shapes_are_checked_on_every_rank(case, needle):
    messages = run_on_ranks(2, _disagreeing_explicit_shapes, case)
    assert messages[0] == messages[1] and needle in messages[0], messages


def _slab_owns_its_storage() -> list[int]:
    """distribute_tensor's slab is a copy of its rows, for every sharded dim: the global tensor can
    be freed (memory per rank ~1/N) and in-place updates of the slab leave the caller's tensor alone."""
    mesh = get_mesh((2,))
    sizes = []
    for dim in range(3):
        full = torch.arange(6 * 4 * 5, dtype=torch.float32).view(6, 4, 5)
        slab = distribute_tensor(full, mesh, [Shard(dim)]).to_local()
        assert slab.untyped_storage().data_ptr() != full.untyped_storage().data_ptr(), dim
        slab.add_(1000)
        assert torch.equal(full, torch.arange(6 * 4 * 5, dtype=torch.float32).view(6, 4, 5)), dim
        sizes.append(slab.untyped_storage().nbytes())
    return sizes


def test_distributed_slab_owns_its_storage():
    # float32 slabs of a (6, 4, 5) tensor split over 2 ranks along dims 0, 1 and 2 (5 -> 3 + 2)
    rank0, rank1 = run_on_ranks(2, _slab_owns_its_storage)
    assert rank0 == [3 * 4 * 5 * 4, 6 * 2 * 5 * 4, 6 * 4 * 3 * 4]
    assert rank1 == [3 * 4 * 5 * 4, 6 * 2 * 5 * 4, 6 * 4 * 2 * 4]
