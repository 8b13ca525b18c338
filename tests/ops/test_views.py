"""view / reshape / flatten / unflatten / patchify on uneven shards, forward and backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops import views
from physics_dp.ops.views import view_groups
from physics_dp.shard_tensor import Replicate, Shard, ShardTensorSpec, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

LAYOUTS = [(1,), (2,), (3,), (4,), (2, 2)]


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, H/p * W/p, p*p*C), the ViT/DiT token layout."""
    n, c, h, w = x.shape
    x = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(n, (h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, p: int, h: int, w: int) -> torch.Tensor:
    n, _, d = tokens.shape
    c = d // (p * p)
    x = tokens.reshape(n, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(n, c, h, w)


CASES = {
    "flatten_hw": (lambda x: x.flatten(2) * 2, (2, 3, 7, 5)),
    "flatten_hw_view": (lambda x: x.view(2, 3, 35).sin(), (2, 3, 7, 5)),
    "unflatten_w": (lambda x: x.unflatten(3, (2, 3)).cos(), (2, 3, 7, 6)),
    "split_h_rows": (lambda x: x.reshape(2, 3, 4, 2, 5).sum(3), (2, 3, 8, 5)),
    "merge_batch_channels": (lambda x: x.reshape(6, 7, 5) + 1, (2, 3, 7, 5)),
    "round_trip_tokens": (lambda x: x.flatten(2).transpose(1, 2).reshape(2, 7, 5, 3), (2, 3, 7, 5)),
    "patchify": (lambda x: patchify(x, 2) * 1.5, (2, 3, 8, 6)),
    "patchify_unpatchify": (lambda x: unpatchify(patchify(x, 2).tanh(), 2, 8, 6), (1, 2, 8, 6)),
}


def _placements(mesh):
    return [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]


def _run(mesh_shape, name, skewed):
    fn, shape = CASES[name]
    mesh = get_mesh(mesh_shape)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    placements = _placements(mesh)
    sizes = None
    if skewed and mesh.size(0) > 1:
        h = shape[2]
        split = [1] * (mesh.size(0) - 1) + [h - (mesh.size(0) - 1)]
        sizes = [{0: split}]
    assert_sharded_matches(fn, [x], mesh, [placements], sharding_sizes=sizes)
    return True


@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_view_family_matches_single_device(mesh_shape, name, skewed):
    run_on_ranks(_world(mesh_shape), _run, mesh_shape, name, skewed)


def _world(mesh_shape):
    n = 1
    for s in mesh_shape:
        n *= s
    return n




def _flatten_keeps_shard_without_communication(world):
    mesh = get_mesh((world,))
    x = distribute_tensor(torch.randn(2, 3, 7, 5), mesh, [Shard(2)])
    with count_communication() as log:
        y = x.flatten(2)
    assert log.calls == 0
    assert y.placements == (Shard(2),)
    assert y._spec.axis_sizes[0] == tuple(5 * s for s in x._spec.axis_sizes[0])
    z = distribute_tensor(torch.randn(2, 3, 7, 5), mesh, [Replicate()]).flatten(1)
    assert z.placements == (Replicate(),)
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_flatten_of_a_leading_sharded_dim_is_free(world):
    run_on_ranks(world, _flatten_keeps_shard_without_communication, world)


def _views_of_equal_shapes_with_different_splits():
    """View plans are cached per input spec: the same global shape split two ways views two ways."""
    mesh = get_mesh((2,))
    full = torch.arange(2 * 3 * 7 * 5, dtype=torch.float32).reshape(2, 3, 7, 5)
    results = []
    for sizes in ((2, 5), (5, 2), (2, 5)):
        x = distribute_tensor(full, mesh, [Shard(2)], sharding_sizes={0: sizes})
        flat = x.view(2, 3, 35)
        torch.testing.assert_close(flat.full_tensor(), full.view(2, 3, 35))
        results.append(flat._spec.axis_sizes[0])
    return results, holds_a_mesh(views._VIEW_PLANS)


def holds_a_mesh(value) -> bool:
    """Whether ``value`` (nested tuples, dicts and dataclasses) references a mesh, a spec (which holds
    one) or a process group: a module-level cache must not keep the groups of a destroyed mesh alive."""
    if isinstance(value, (DeviceMesh, ShardTensorSpec, ProcessGroup)):
        return True
    if isinstance(value, dict):
        return any(holds_a_mesh(k) or holds_a_mesh(v) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return any(holds_a_mesh(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(holds_a_mesh(getattr(value, field.name)) for field in dataclasses.fields(value))
    return False


def _view_plans_per_spec():
    """How many times views of one layout were planned: per spec object and output shape."""
    mesh = get_mesh((2,))
    x = distribute_tensor(torch.randn(2, 3, 8, 5), mesh, [Shard(2)])
    planned = []
    real = views._planned_view
    views._planned_view = lambda spec, shape: planned.append(shape) or real(spec, shape)
    try:
        first, again, of_pointwise = x.view(2, 3, 40), x.view(2, 3, 40), (x * 2).view(2, 3, 40)
        other = x.view(2, 24, 5)
        torch.testing.assert_close(of_pointwise.full_tensor(), x.full_tensor().view(2, 3, 40) * 2)
        torch.testing.assert_close(other.full_tensor(), x.full_tensor().view(2, 24, 5))
    finally:
        views._planned_view = real
    return planned, first._spec is again._spec is of_pointwise._spec


def _memo_sizes_of_ever_new_views():
    from physics_dp.shard_tensor import spec as spec_module

    x = distribute_tensor(torch.randn(4, 5040), get_mesh((2,)), [Shard(0)])
    divisors = [d for d in range(1, 5041) if 5040 % d == 0]
    shapes = [(4, a, b, 5040 // (a * b)) for a in divisors for b in divisors if 5040 % (a * b) == 0][:150]
    sizes = []
    for shape in shapes:  # more than a spec keeps
        x.view(shape)
        sizes.append(len(x._spec._derived))
    return len(shapes), max(sizes), spec_module._DERIVED_LIMIT


def test_a_spec_keeps_a_bounded_number_of_view_plans():
    for shapes, largest, limit in run_on_ranks(2, _memo_sizes_of_ever_new_views):
        assert shapes > limit and largest <= limit


def test_views_of_one_layout_plan_once_per_spec():
    # a pointwise result keeps its input's spec, so its views reuse the plan too
    for planned, same_spec in run_on_ranks(2, _view_plans_per_spec):
        assert planned == [(2, 3, 40), (2, 24, 5)]
        assert same_spec


def test_a_view_follows_the_split_of_each_input():
    # and the plan cache holds no mesh: a mesh holds its process groups, which must die with it
    for sizes, holds_a_mesh in run_on_ranks(2, _views_of_equal_shapes_with_different_splits):
        assert sizes == [(10, 25), (25, 10), (10, 25)]
        assert not holds_a_mesh


def test_view_groups():
    assert view_groups((2, 3, 7, 5), (2, 3, 35)) == [([0], [0]), ([1], [1]), ([2, 3], [2])]
    assert view_groups((1, 7), (7,)) == [([0, 1], [0])]
    assert view_groups((6, 4), (2, 12)) == [([0, 1], [0, 1])]
