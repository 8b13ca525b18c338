"""Gradients through every conversion, and autograd semantics of ShardTensor as a tensor."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Partial, Replicate, Shard, ShardTensor, distribute_tensor, scatter_tensor
from physics_dp.shard_tensor.conversions import shared_local
from physics_dp.testing import get_mesh, run_on_ranks

from ._cases import MESHES, SHAPES, expected_local, global_tensor, placement_combos, world_of


def _redistribute_grads(mesh_shape, shape):
    """d(sum(w * redistribute(x)))/dx == w for every leaf layout and target layout."""
    mesh = get_mesh(mesh_shape)
    g = global_tensor(shape)
    w = global_tensor(shape, seed=7)
    leaves = placement_combos(mesh.ndim, len(shape), partial_ops=())
    targets = placement_combos(mesh.ndim, len(shape), partial_ops=("sum", "avg"))
    for src in leaves:
        for dst in targets:
            x = distribute_tensor(g, mesh, src).requires_grad_(True)
            y = x.redistribute(placements=dst)
            if any(p.is_partial() for p in dst):
                (y.full_tensor() * w).sum().backward()
            else:
                y.backward(distribute_tensor(w, mesh, dst))
            assert x.grad.shape == g.shape
            assert torch.equal(x.grad.full_tensor(), w), f"{src} -> {dst}"
    return True


@pytest.mark.parametrize("shape_kind", ["uneven", "tiny"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_gradient_through_every_redistribute(mesh_shape, shape_kind):
    run_on_ranks(world_of(mesh_shape), _redistribute_grads, mesh_shape, SHAPES[shape_kind])


def _from_local_grads(mesh_shape, shape):
    mesh = get_mesh(mesh_shape)
    g = global_tensor(shape)
    w = global_tensor(shape, seed=5)
    coordinate = mesh.get_coordinate()
    checked = []
    for placements in placement_combos(mesh.ndim, len(shape), partial_ops=("sum", "avg")):
        local = expected_local(g, mesh, placements, coordinate).detach().clone().requires_grad_(True)
        x = ShardTensor.from_local(local, mesh, placements)
        assert not x.is_leaf and x.requires_grad
        (x.full_tensor() * w).sum().backward()
        # single device: the global value's gradient is w; a rank's slab gets its part of it,
        # a replica all of it, and an averaged contribution 1/n of it.
        want = expected_local(w, mesh, [p if not p.is_partial() else Replicate() for p in placements], coordinate)
        for axis, p in enumerate(placements):
            if p.is_partial() and p.reduce_op == "avg":
                want = want / mesh.size(axis)
        assert torch.equal(local.grad, want), placements
        checked.append(str(placements))
    return checked


@pytest.mark.parametrize("shape_kind", ["even", "uneven"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_gradient_through_from_local_and_full_tensor(mesh_shape, shape_kind):
    run_on_ranks(world_of(mesh_shape), _from_local_grads, mesh_shape, SHAPES[shape_kind])


def _to_local_and_scatter_grads(world):
    mesh = get_mesh((world,))
    g = global_tensor((7, 3))
    w = global_tensor((7, 3), seed=2)
    x = scatter_tensor(g if dist.get_rank() == 0 else None, 0, mesh, [Shard(0)], requires_grad=True)
    assert x.is_leaf and x.requires_grad and x.grad is None
    w_local = expected_local(w, mesh, [Shard(0)], mesh.get_coordinate())
    (x.to_local() * w_local).sum().backward()
    assert isinstance(x.grad, ShardTensor)
    assert torch.equal(x.grad.full_tensor(), w)
    d = ShardTensor.from_dtensor(x.to_dtensor())
    assert torch.equal(d.full_tensor(), g)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gradient_through_to_local_scatter_and_dtensor(world):
    run_on_ranks(world, _to_local_and_scatter_grads, world)


def _dtensor_bridge_grads(world):
    from torch.distributed.tensor import distribute_tensor as dt_distribute

    mesh = get_mesh((world,))
    g = global_tensor((7, 3))
    w = global_tensor((7, 3), seed=2)
    d = dt_distribute(g, mesh, [Shard(0)]).requires_grad_(True)
    s = ShardTensor.from_dtensor(d)
    assert torch.equal(s.full_tensor(), g)
    (s.full_tensor() * w).sum().backward()
    assert torch.equal(d.grad.full_tensor(), w)
    x = distribute_tensor(g, mesh, [Shard(0)]).requires_grad_(True)  # balanced, not chunk, on 4 ranks
    back = x.to_dtensor()
    assert torch.equal(back.full_tensor(), g)
    (back.full_tensor() * w).sum().backward()
    assert torch.equal(x.grad.full_tensor(), w)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dtensor_bridge_round_trip_with_gradients(world):
    run_on_ranks(world, _dtensor_bridge_grads, world)


def _requires_grad_semantics():
    mesh = get_mesh((2,))
    g = global_tensor((5, 4))
    x = distribute_tensor(g, mesh, [Shard(0)])
    assert not x.requires_grad and x.is_leaf
    assert x.requires_grad_() is x and x.requires_grad
    x.requires_grad = False
    assert not x.requires_grad
    x.requires_grad = True
    y = x * 3.0
    assert isinstance(y, ShardTensor) and y.requires_grad and not y.is_leaf and y.grad_fn is not None
    with pytest.raises(RuntimeError):
        y.requires_grad = False  # same error as on a plain non-leaf tensor
    y.retain_grad()
    seen = []
    x.register_hook(lambda grad: seen.append(type(grad).__name__) or grad * 2)
    (y * 1.5).sum().backward()
    assert isinstance(y.grad, ShardTensor) and torch.equal(y.grad.full_tensor(), torch.full((5, 4), 1.5))
    assert seen == ["ShardTensor"]
    assert torch.equal(x.grad.full_tensor(), torch.full((5, 4), 9.0))  # 3 * 1.5, doubled by the hook
    x.grad = None
    assert x.grad is None
    detached = y.detach()
    assert isinstance(detached, ShardTensor) and not detached.requires_grad and detached.is_leaf
    with torch.no_grad():
        z = x * 2
    assert not z.requires_grad
    return True


def test_requires_grad_is_leaf_grad_retain_grad_and_hooks():
    run_on_ranks(2, _requires_grad_semantics)


def _plain_parameter_grad_reduced_once(world):
    mesh = get_mesh((world,))
    g = global_tensor((6, 5))
    w = torch.linspace(-1, 1, 5, requires_grad=True)
    x = distribute_tensor(g, mesh, [Shard(0)])
    y = torch.tanh(x * w + 0.5)
    loss = y.sum()
    with count_communication() as log:
        loss.backward()
    w_ref = w.detach().clone().requires_grad_(True)
    torch.tanh(g * w_ref + 0.5).sum().backward()
    assert type(w.grad) is torch.Tensor
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-5, rtol=1e-5)
    return log.kinds()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plain_parameter_gradient_summed_over_mesh_exactly_once(world):
    kinds = run_on_ranks(world, _plain_parameter_grad_reduced_once, world)
    for rank_kinds in kinds:
        assert rank_kinds.count("all_reduce") == (1 if world > 1 else 0), rank_kinds


def _partial_gradient_is_replicated():
    mesh = get_mesh((2,))
    g = global_tensor((4, 3))
    x = distribute_tensor(g, mesh, [Shard(0)]).requires_grad_(True)
    s = ShardTensor.from_local(x.to_local().sum(dim=0), mesh, [Partial("sum")])  # a pending sum
    r = s.redistribute(placements=[Replicate()])
    r.backward(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
    assert torch.equal(x.grad.full_tensor(), torch.ones(4, 3))
    return True


def test_gradient_of_partial_reduction():
    run_on_ranks(2, _partial_gradient_is_replicated)


# ----- round trips: from_local -> to_local and to_local -> from_local are the identity -------
ROUND_TRIP_MESHES = [(2,), (3,), (2, 2)]


def _rank_values(shape, salt: int) -> torch.Tensor:
    """Values that differ between ranks (a rank's own contribution, its own cotangent)."""
    return global_tensor(shape, seed=salt + 17 * dist.get_rank())


def _from_local_to_local_is_identity(mesh_shape, shape):
    """Each rank's slab gradient passes through unchanged, as under plain autograd (and DTensor)."""
    from torch.distributed.tensor import DTensor

    mesh = get_mesh(mesh_shape)
    placements_checked = []
    for placements in placement_combos(mesh.ndim, len(shape), partial_ops=("sum", "avg")):
        local_shape = expected_local(global_tensor(shape), mesh, placements, mesh.get_coordinate()).shape
        local = _rank_values(local_shape, 1).requires_grad_(True)
        cotangent = _rank_values(local_shape, 2)
        ShardTensor.from_local(local, mesh, placements).to_local().backward(cotangent)
        assert torch.equal(local.grad, cotangent), placements
        # DTensor 2.13 agrees (even shapes only: DTensor assumes the torch.chunk layout)
        if all(shape[p.dim] % mesh.size(a) == 0 for a, p in enumerate(placements) if p.is_shard()):
            d_local = local.detach().clone().requires_grad_(True)
            DTensor.from_local(d_local, mesh, placements, run_check=False).to_local().backward(cotangent)
            assert torch.equal(d_local.grad, local.grad), placements
        placements_checked.append(placements)
    return len(placements_checked)


@pytest.mark.parametrize("shape_kind", ["even", "uneven"])
@pytest.mark.parametrize("mesh_shape", ROUND_TRIP_MESHES, ids=str)
def test_from_local_then_to_local_is_identity_for_autograd(mesh_shape, shape_kind):
    run_on_ranks(world_of(mesh_shape), _from_local_to_local_is_identity, mesh_shape, SHAPES[shape_kind])


def _to_local_from_local_is_identity(mesh_shape, shape):
    """Inserting ``from_local(x.to_local())`` anywhere changes no gradient."""
    mesh = get_mesh(mesh_shape)
    coordinate = mesh.get_coordinate()
    w = global_tensor(shape, seed=3)
    for placements in placement_combos(mesh.ndim, len(shape), partial_ops=("sum", "avg")):
        slab = expected_local(global_tensor(shape), mesh, placements, coordinate)
        sizes = {axis: [list(s.shape) for s in _slabs_along(shape, mesh, placements, axis)]
                 for axis, p in enumerate(placements) if p.is_shard()}
        own_cotangent = _rank_values(slab.shape, 4)
        grads = []
        for round_trip in (False, True):
            leaf = slab.clone().requires_grad_(True)
            x = ShardTensor.from_local(leaf, mesh, placements)
            if round_trip:
                x = ShardTensor.from_local(x.to_local(), mesh, placements, sharding_shapes=sizes)
            # a function of the global value and a rank-specific use of the slab, together
            loss = (x.full_tensor() * w).sum() + (x.to_local() * own_cotangent).sum()
            loss.backward()
            grads.append(leaf.grad)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6, msg=str(placements))
    return True


def _slabs_along(shape, mesh, placements, axis):
    """The slab of every coordinate along mesh ``axis`` (this rank's coordinates elsewhere)."""
    coordinate = list(mesh.get_coordinate())
    slabs = []
    for c in range(mesh.size(axis)):
        coordinate[axis] = c
        slabs.append(expected_local(global_tensor(shape), mesh, placements, coordinate))
    return slabs


@pytest.mark.parametrize("shape_kind", ["even", "uneven"])
@pytest.mark.parametrize("mesh_shape", ROUND_TRIP_MESHES, ids=str)
def test_to_local_then_from_local_is_identity_for_autograd(mesh_shape, shape_kind):
    run_on_ranks(world_of(mesh_shape), _to_local_from_local_is_identity, mesh_shape, SHAPES[shape_kind])


def _partial_round_trip_of_the_issue():
    mesh = get_mesh((2,))
    w = torch.randn(4, 3, requires_grad=True)
    ShardTensor.from_local(w, mesh, [Partial()]).to_local().sum().backward()
    assert torch.equal(w.grad, torch.ones(4, 3))  # plain autograd's answer (was 2.0: scaled by the world size)
    return True


def test_partial_round_trip_does_not_scale_the_gradient():
    run_on_ranks(2, _partial_round_trip_of_the_issue)


def _max_contribution_gradient_raises():
    mesh = get_mesh((2,))
    local = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(NotImplementedError, match="Partial\\('max'\\)"):
        ShardTensor.from_local(local, mesh, [Partial("max")]).to_local().sum().backward()
    return True


def test_gradient_of_a_max_contribution_raises_instead_of_guessing():
    run_on_ranks(2, _max_contribution_gradient_raises)


# ----- code run during the backward reaches the handlers ---------------------------------------------
def _checkpointed_block(reentrant: bool, sizes: list[int]) -> list[float]:
    """``torch.utils.checkpoint`` recomputes the forward inside the backward: with the handlers
    bypassed there (torch functions were off below ``backward``), the recomputation took torch's
    own composites, whose saved tensors or rules differed (CheckpointError / no rule for
    ``native_group_norm_backward``).  The dropout mask must come back the same too."""

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, 3, padding=1)

    def block(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.nn.functional.gelu(conv(t)), 0.3) + torch.nn.functional.group_norm(t, 1)

    values = torch.randn(2, 3, sum(sizes), 6, generator=torch.Generator().manual_seed(1))
    results = []
    for checkpointed in (False, True):
        x = distribute_tensor(values, get_mesh((len(sizes),)), [Shard(2)], {0: sizes}).requires_grad_()
        conv.zero_grad()
        torch.manual_seed(42)
        y = checkpoint(block, x, use_reentrant=reentrant) if checkpointed else block(x)
        y.square().sum().backward()
        results.append((y.full_tensor(), x.grad.full_tensor(), conv.weight.grad.clone()))
    return [(a - b).abs().max().item() for a, b in zip(*results)]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("sizes", [[3, 5], [3, 0, 5]], ids=["2 ranks", "3 ranks, an empty shard"])
def test_activation_checkpointing_recomputes_the_sharded_forward(reentrant: bool, sizes: list[int]) -> None:
    for diffs in run_on_ranks(len(sizes), _checkpointed_block, reentrant, sizes):
        assert max(diffs) == 0.0, diffs


# ----- op handlers share one conversion per tensor ----------------------------------------------
class _ShardTensorAdds(TorchDispatchMode):
    """Counts additions of ShardTensors (how autograd sums the gradients of a tensor read twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add.Tensor and any(isinstance(a, ShardTensor) for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _two_ops_read_one_tensor(sizes: list[int]) -> tuple[list[float], int]:
    """A tensor read by a group norm and a 1x1 conv (a decoder block's input): gradients equal one
    device's, and they add up in the local graph, not as ShardTensors."""
    torch.manual_seed(0)
    norm, skip = torch.nn.GroupNorm(2, 8), torch.nn.Conv2d(8, 4, 1)
    values = torch.randn(2, 8, sum(sizes), 5)

    def loss(x: torch.Tensor) -> torch.Tensor:
        h = x * 1.5
        return norm(h).square().sum() + skip(h).square().sum()

    plain = values.clone().requires_grad_()
    loss(plain).backward()
    expected = [plain.grad, norm.weight.grad.clone(), skip.weight.grad.clone()]
    norm.zero_grad()
    skip.zero_grad()
    x = distribute_tensor(values, get_mesh((len(sizes),)), [Shard(2)], {0: sizes}).requires_grad_()
    total = loss(x)
    with _ShardTensorAdds() as adds:
        total.backward()
    got = [x.grad.full_tensor(), norm.weight.grad, skip.weight.grad]
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, expected)], adds.count


@pytest.mark.parametrize("sizes", [[4, 3], [3, 2, 4]], ids=["2 ranks uneven", "3 ranks"])
def test_a_tensor_read_by_two_ops_sums_its_gradients_in_the_local_graph(sizes: list[int]) -> None:
    for diffs, adds in run_on_ranks(len(sizes), _two_ops_read_one_tensor, sizes):
        assert max(diffs) < 1e-5, diffs  # relative to the largest gradient
        assert adds == 0  # one per extra read when each read converted the tensor anew


def _conversions_shared_until_written(world: int) -> list[bool]:
    x = distribute_tensor(torch.randn(3, 2 * world), get_mesh((world,)), [Shard(1)]).requires_grad_()
    y = x * 2
    first = shared_local(y)
    checks = [shared_local(y) is first, first.grad_fn is not None]
    with torch.no_grad():
        y.add_(1)  # written in place: the next conversion is a new one
        checks.append(shared_local(y) is y._local_tensor)  # no autograd: the slab itself
    again = shared_local(y)
    checks += [again is not first, torch.equal(again, first), shared_local(y) is again]  # (views of one slab)
    y.mul_(3)  # in place under autograd: the conversion must follow the new graph
    checks.append(shared_local(y).grad_fn is not again.grad_fn)
    copy.deepcopy(x)  # the cache lives outside the tensor: copies and pickles never meet it
    return checks


def test_op_handlers_share_a_conversion_until_the_tensor_is_written():
    for checks in run_on_ranks(2, _conversions_shared_until_written, 2):
        assert all(checks), checks


def _shared_conversions_end_with_their_tensors(world: int) -> list[bool]:
    leaf = distribute_tensor(torch.randn(3, 2 * world), get_mesh((world,)), [Shard(1)]).requires_grad_()
    inner = leaf * 2
    checks = [shared_local(leaf) is not shared_local(leaf), shared_local(inner) is shared_local(inner)]  # leaves: never cached
    refs = [weakref.ref(leaf), weakref.ref(inner)]
    (shared_local(inner).sum() + shared_local(leaf).sum()).backward()
    del leaf, inner
    gc.collect()
    return checks + [ref() is None for ref in refs]


def test_shared_conversions_keep_no_tensor_alive():
    """A leaf's conversion ends in its gradient accumulator, which holds the leaf: cached, it would
    keep its own key alive.  Leaves are not cached; other tensors' entries end with them."""
    for checks in run_on_ranks(2, _shared_conversions_end_with_their_tensors, 2):
        assert all(checks), checks


def _checkpointed_reads_of_one_tensor(reentrant: bool) -> list[float]:
    """A checkpointed block reading a non-leaf input twice: the recompute meets the cached conversion."""
    torch.manual_seed(0)
    norm, conv = torch.nn.GroupNorm(2, 4), torch.nn.Conv2d(4, 4, 1)
    values = torch.randn(1, 4, 7, 5)
    results = []
    for checkpointed in (False, True):
        x = distribute_tensor(values, get_mesh((2,)), [Shard(2)], {0: [4, 3]}).requires_grad_()
        norm.zero_grad()
        conv.zero_grad()
        h = x * 1.5

        def block(t: torch.Tensor) -> torch.Tensor:
            return norm(t) * conv(t)

        y = checkpoint(block, h, use_reentrant=reentrant) if checkpointed else block(h)
        (y.square().sum() + h.sum()).backward()
        results.append((x.grad.full_tensor(), norm.weight.grad.clone(), conv.weight.grad.clone()))
    return [(a - b).abs().max().item() for a, b in zip(*results)]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_a_block_that_reads_its_input_twice(reentrant: bool) -> None:
    for diffs in run_on_ranks(2, _checkpointed_reads_of_one_tensor, reentrant):
        assert max(diffs) == 0.0, diffs
