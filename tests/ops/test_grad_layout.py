"""A sharded leaf's gradient comes back in the leaf's own placements and split, on every op path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

# Each path ends in a reduction; before, a path of only views, selects or reductions handed
# every rank the whole global gradient as a Replicate tensor.
PATHS = {
    "pointwise_sum": lambda x: (x * 3).sum(),
    "mean": lambda x: torch.tanh(x).mean(),
    "sum_over_dims": lambda x: x.sum(dim=(2, 3)).pow(2).sum(),
    "amax": lambda x: x.amax(),
    "vector_norm": lambda x: torch.linalg.vector_norm(x),
    "conv": lambda x: F.conv2d(x, torch.linspace(-1, 1, 54).reshape(2, 3, 3, 3), padding=1).square().mean(),
    "group_norm": lambda x: F.group_norm(x, 3).sin().sum(),
    "avg_pool": lambda x: F.avg_pool2d(x, 2).sum(),
    "interpolate": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear").sum(),
    "reshape": lambda x: x.reshape(2, 3, -1).sum(),
    "flatten": lambda x: (x.flatten(2) ** 2).sum(),
    "permute": lambda x: x.permute(0, 2, 3, 1).sum(),
    "select": lambda x: x[:, 0].sum(),
    "slice": lambda x: (x[:, :, 1:5] * 2).sum(),
    "index_select": lambda x: x.index_select(1, torch.tensor([0, 2])).sum(),
}
MESH_LAYOUTS = [((2,), [Shard(2)]), ((3,), [Shard(2)]), ((2, 2), [Shard(2), Shard(3)])]


# On an H x W mesh a flatten of (H, W) makes a strided dim (issue 12, gap 2); its gradient comes
# back through the inverse view in the leaf's layout, tested on its own below.
TOKEN_FLATTENS = ("reshape", "flatten")


def _leaf_gradient_layouts(mesh_shape, placements, names):
    mesh = get_mesh(mesh_shape)
    g = torch.linspace(-2, 3, 2 * 3 * 7 * 6).reshape(2, 3, 7, 6)
    wrong = []
    for name in names:
        fn = PATHS[name]
        x = distribute_tensor(g, mesh, placements).requires_grad_(True)
        fn(x).backward()
        ref = g.clone().requires_grad_(True)
        fn(ref).backward()
        slab, grad = x.to_local(), x.grad
        # the leaf's own layout, and never more than its slab: in extent or in memory behind it
        if (grad.placements, grad._spec.axis_sizes) != (x.placements, x._spec.axis_sizes):
            wrong.append((name, grad._spec))
        elif grad.to_local().untyped_storage().nbytes() > max(slab.numel(), 1) * slab.element_size():
            wrong.append((name, grad.to_local().untyped_storage().nbytes()))
        torch.testing.assert_close(grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert not wrong, wrong
    return True


@pytest.mark.parametrize("mesh_shape,placements", MESH_LAYOUTS, ids=str)
def test_sharded_leaf_gradient_keeps_the_leaf_layout_on_every_path(mesh_shape, placements):
    names = [n for n in PATHS if len(mesh_shape) == 1 or n not in TOKEN_FLATTENS]
    run_on_ranks(math.prod(mesh_shape), _leaf_gradient_layouts, mesh_shape, placements, names)


def test_token_flatten_gradient_on_a_2d_mesh_keeps_the_leaf_layout():
    run_on_ranks(4, _leaf_gradient_layouts, (2, 2), [Shard(2), Shard(3)], TOKEN_FLATTENS)


def _optimizer_steps_on_sharded_leaf(world, optimizer_name):
    mesh = get_mesh((world,))
    g = torch.linspace(-1, 1, 7 * 5).reshape(7, 5)
    target = torch.cos(torch.arange(35.0)).reshape(7, 5)

    def steps(field, target_):
        make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "adam": lambda p: torch.optim.Adam(p, lr=0.05)}
        optimizer = make[optimizer_name]([field])
        for _ in range(3):
            optimizer.zero_grad()
            ((field - target_) ** 2).mean().backward()
            optimizer.step()
        return field

    field = steps(distribute_tensor(g.clone(), mesh, [Shard(0)]).requires_grad_(True), distribute_tensor(target, mesh, [Shard(0)]))
    ref = steps(g.clone().requires_grad_(True), target)
    assert field.placements == (Shard(0),) and field.grad.placements == (Shard(0),)
    torch.testing.assert_close(field.detach().full_tensor(), ref.detach(), rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
@pytest.mark.parametrize("world", [2, 3])
def test_torch_optimizer_steps_a_sharded_leaf_like_one_device(world, optimizer_name):
    run_on_ranks(world, _optimizer_steps_on_sharded_leaf, world, optimizer_name)


def _mean_gradients_stay_views() -> list[tuple]:
    mesh = get_mesh((2,))
    found = []
    for reduce in (lambda y: y.mean(), lambda y: torch.mean(y, (2, 3)).sum(), lambda y: y.mean(dim=2, keepdim=True).sum()):
        x = distribute_tensor(torch.randn(2, 3, 8, 6), mesh, [Shard(2)]).requires_grad_(True)
        y = x.square()
        seen = []
        y.register_hook(seen.append)
        reduce(y).backward()
        local = seen[0].to_local()
        found.append((tuple(local.shape), local.untyped_storage().nbytes(), x.to_local().nbytes))
    return found


def test_a_mean_hands_back_a_view_of_the_slab_not_the_global_gradient():
    """torch's mean backward divides the expanded gradient: every rank wrote the global shape."""
    for per_rank in run_on_ranks(2, _mean_gradients_stay_views):
        for shape, stored, slab in per_rank:
            assert shape == (2, 3, 4, 6) and stored < slab, (shape, stored, slab)  # a copy would hold the slab
