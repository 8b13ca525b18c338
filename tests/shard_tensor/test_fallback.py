"""Ops without a physics_dp handler go through DTensor's rules with our sizes: uneven shards stay exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.shard_tensor.fallback import ShardingRuleError
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from ._cases import world_of

LAYOUTS = [(1,), (2,), (3,), (4,), (2, 2)]


def _x(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _shard_h(mesh):
    """Shard dim 2 of an (N, C, H, W) field; on 2-D meshes H over axis 0 and W over axis 1."""
    return [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]


# name -> (fn, input shapes, placements builder (mesh -> list per input))
CASES = {
    "slice_unsharded_dim": (lambda x: x[:, 1:3, :, 1:], [(2, 4, 7, 5)], lambda m: [[Shard(2)] + [Replicate()] * (m.ndim - 1)]),
    "slice_sharded_dim": (lambda x: x[:, :, 1:6], [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "transpose": (lambda x: x.transpose(1, 3), [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "permute": (lambda x: x.permute(0, 2, 3, 1).contiguous(), [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "cat_unsharded_dim": (lambda x, y: torch.cat([x, y * 2], dim=1), [(2, 3, 7, 5), (2, 2, 7, 5)], lambda m: [_shard_h(m)] * 2),
    "cat_sharded_dim": (lambda x, y: torch.cat([x, y], dim=2), [(1, 2, 7, 5), (1, 2, 3, 5)], lambda m: [_shard_h(m)] * 2),
    "cast_double": (lambda x: x.double() * 3, [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "cast_half_back": (lambda x: x.half().float(), [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "max_unsharded_dim": (lambda x: torch.max(x, dim=1), [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "max_sharded_dim": (lambda x: torch.max(x, dim=2).values, [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "broadcast_plain_param": (lambda x, b: x * b + b, [(2, 3, 7, 5), (3, 1, 1)], lambda m: [_shard_h(m), None]),
    "broadcast_replicated_row": (lambda x, r: x - r, [(2, 3, 7, 5), (7, 5)], lambda m: [_shard_h(m), [Replicate()] * m.ndim]),
    "broadcast_sharded_both": (lambda x, y: torch.sigmoid(x) * y, [(2, 3, 7, 5), (1, 3, 7, 5)], lambda m: [_shard_h(m)] * 2),
    "sum_sharded_dim": (lambda x: x.sum(dim=(2, 3)), [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "sum_all": (lambda x: (x * x).sum(), [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "einsum_channels": (lambda x, w: torch.einsum("nchw,dc->ndhw", x, w), [(2, 3, 7, 5), (4, 3)], lambda m: [_shard_h(m), None]),
    "where_mask": (lambda x: torch.where(x > 0, x, x * 0.1), [(2, 3, 7, 5)], lambda m: [_shard_h(m)]),
    "pixel_shuffle_resizes_sharded_dims": (lambda x: F.pixel_shuffle(x, 2), [(1, 8, 7, 5)], lambda m: [_shard_h(m)]),
    # kernels that pick their algorithm by layout: the gradient was silently wrong on a gathered slab
    "det_of_a_transposed_view": (lambda x: torch.linalg.det(x.mT), [(2, 3, 5, 5)], lambda m: [_shard_h(m)]),
    "slogdet_of_a_permuted_view": (
        lambda x: torch.linalg.slogdet(x.permute(1, 0, 3, 2) * 2).logabsdet, [(2, 3, 5, 5)], lambda m: [_shard_h(m)]
    ),
}

SIZES = {"balanced": None, "skewed": "skewed"}


def _shard_w(mesh):
    """Shard the last dim of an (N, C, H, W) field; on 2-D meshes H over axis 0 and W over axis 1."""
    return [Shard(3)] if mesh.ndim == 1 else [Shard(2), Shard(3)]


def _take_along_argmax(x):
    return torch.take_along_dim(x, x.argmax(dim=2, keepdim=True), dim=2)


# DTensor's rules answer these with private partials: a lookup through a replicated index into a
# sharded dim (_MaskPartial: each rank looks up the rows it holds, the rest are zeroed and summed)
# and a norm over a sharded dim (_NormPartial(p): each rank holds the p-norm of its part).  H and
# W of 12 split evenly over 2, 3 and 4 ranks ("balanced") and unevenly ("skewed"); float64 to 1e-10.
PRIVATE_PARTIAL_CASES = {
    "take_along_dim_argmax_of_sharded_dim": (_take_along_argmax, [(2, 3, 12, 12)], lambda m: [_shard_h(m)]),
    "aten_gather_replicated_index_into_sharded_dim": (
        lambda x: torch.ops.aten.gather(x, 2, x.argmax(dim=2, keepdim=True)), [(2, 3, 12, 12)], lambda m: [_shard_h(m)]
    ),
    "embedding_of_row_sharded_weight": (
        lambda w: F.embedding(torch.tensor([[0, 11, 3], [6, 6, 1]]), w), [(12, 4)], lambda m: [[Shard(0)] + [Replicate()] * (m.ndim - 1)]
    ),
    "pairwise_distance_over_sharded_dim": (F.pairwise_distance, [(2, 3, 12, 12)] * 2, lambda m: [_shard_w(m)] * 2),
    "pairwise_distance_p3_over_sharded_dim": (
        lambda a, b: F.pairwise_distance(a, b, p=3), [(2, 3, 12, 12)] * 2, lambda m: [_shard_w(m)] * 2
    ),
}


def _skewed(mesh, placements, shape):
    """A non-chunk split: everything on the last coordinate of each sharded axis but one row per rank."""
    sizes = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            n, extent = mesh.size(axis), shape[p.dim]
            split = [min(1, extent)] * n
            split[-1] = extent - sum(split[:-1])
            if split[-1] < 0:
                split = [1] * extent + [0] * (n - extent)
            sizes[axis] = split
    return sizes


def _run_case(mesh_shape, name, split, dtype=torch.float32, tol=1e-5):
    fn, shapes, placements_of = {**CASES, **PRIVATE_PARTIAL_CASES}[name]
    mesh = get_mesh(mesh_shape)
    inputs = [_x(s, seed=i).to(dtype) for i, s in enumerate(shapes)]
    placements = placements_of(mesh)
    sizes = None
    if split == "skewed":
        sizes = [None if p is None else _skewed(mesh, p, s) for p, s in zip(placements, shapes)]
    assert_sharded_matches(fn, inputs, mesh, placements, sharding_sizes=sizes, atol=tol, rtol=tol)
    return True


@pytest.mark.parametrize("split", sorted(SIZES))
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_fallback_op_matches_single_device(mesh_shape, name, split):
    run_on_ranks(world_of(mesh_shape), _run_case, mesh_shape, name, split)


@pytest.mark.parametrize("split", sorted(SIZES))
@pytest.mark.parametrize("name", sorted(PRIVATE_PARTIAL_CASES))
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_dtensor_private_partials_match_single_device(mesh_shape, name, split):
    """take_along_dim raised on DTensor's _MaskPartial index and pairwise_distance on its
    _NormPartial output: the index is now masked with our (uneven) split and the output summed,
    and the partial norm reduced at once; forward and input gradients match one device."""
    run_on_ranks(world_of(mesh_shape), _run_case, mesh_shape, name, split, torch.float64, 1e-10)


def _masked_lookup_with_empty_shards() -> bool:
    mesh = get_mesh((4,))
    x = _x((2, 3, 12, 5)).double()
    sizes = [{0: [0, 5, 0, 7]}]
    assert_sharded_matches(_take_along_argmax, [x], mesh, [[Shard(2)]], sharding_sizes=sizes, atol=1e-10, rtol=1e-10)
    return True


def test_a_masked_lookup_runs_on_empty_shards():
    """A rank holding no rows of the looked-up dim has no row for a masked index to point at: it
    looks up a stand-in row of zeros, and all its outputs are masked."""
    assert all(run_on_ranks(4, _masked_lookup_with_empty_shards))


def _bytes_of_private_partials() -> dict[str, int]:
    mesh = get_mesh((2,))
    x = distribute_tensor(_x((2, 3, 256, 8)), mesh, [Shard(2)])
    index = x.argmax(dim=2, keepdim=True)
    y = distribute_tensor(_x((2, 3, 8, 256), seed=1), mesh, [Shard(3)])
    z = distribute_tensor(_x((2, 3, 8, 256), seed=2), mesh, [Shard(3)])
    sent = {}
    for name, fn in {"take_along_dim": lambda: torch.take_along_dim(x, index, dim=2).full_tensor(),
                     "pairwise_distance": lambda: F.pairwise_distance(y, z).full_tensor()}.items():
        with count_communication() as log:
            fn()
        sent[name] = log.bytes_sent
    return sent


def test_private_partials_send_outputs_not_slabs():
    """The masked lookup and the partial norm send what their (small) outputs hold, never a slab:
    a gather of the looked-up slab would be 2 * 3 * 128 * 8 floats (24 KiB) per rank."""
    for sent in run_on_ranks(2, _bytes_of_private_partials):
        # the lookup's output is (2, 3, 1, 8) and the norms (2, 3, 8): summed, then gathered whole
        assert sent["take_along_dim"] <= 4 * 2 * 3 * 8 * 4, sent
        assert sent["pairwise_distance"] <= 4 * 2 * 3 * 8 * 4, sent


def _resized_split_without_meeting(mesh_shape, sizes):
    mesh = get_mesh(mesh_shape)
    x = _x((2, 8, 14 if sizes else 16, 8))  # every slab an even number of rows
    found = {}
    for name, fn in (("shuffle", lambda t: F.pixel_shuffle(t, 2)), ("unshuffle", lambda t: F.pixel_unshuffle(t, 2))):
        xs = distribute_tensor(x, mesh, _shard_h(mesh), sizes).requires_grad_()
        with count_communication() as log:
            y = fn(xs)
            y.backward(torch.ones_like(y))
        found[name] = (log.calls, y._spec.axis_sizes, xs._spec.axis_sizes)
    return found


@pytest.mark.parametrize("mesh_shape, sizes", [((3,), {0: [4, 6, 4]}), ((2, 2), None)], ids=str)
def test_an_op_resizing_a_sharded_dim_sizes_its_output_without_a_meeting(mesh_shape, sizes):
    """pixel_shuffle scales H's split by 2 and pixel_unshuffle halves it: each rank runs the op on
    meta slabs of every coordinate (it used to all-gather the output extents, which also failed
    inside torch.compile)."""
    for found in run_on_ranks(world_of(mesh_shape), _resized_split_without_meeting, mesh_shape, sizes):
        for name, factor in (("shuffle", 2), ("unshuffle", 0.5)):
            calls, out_sizes, in_sizes = found[name]
            assert calls == 0, (name, calls)
            assert out_sizes == tuple(tuple(int(n * factor) for n in split) for split in in_sizes), (name, out_sizes)


def _pixel_shuffle_with_an_empty_shard() -> bool:
    mesh = get_mesh((3,))
    sizes = [{0: [3, 0, 4]}]
    assert_sharded_matches(lambda x: F.pixel_shuffle(x, 2), [_x((1, 8, 7, 5))], mesh, [_shard_h(mesh)], sharding_sizes=sizes)
    return True


def test_an_empty_shard_gets_an_empty_slab_of_its_spec():
    """torch's pixel_shuffle returns an empty input unreshaped (its backward, pixel_unshuffle, too):
    the fallback gives the empty slab its spec's shape instead of refusing the mismatch."""
    assert all(run_on_ranks(3, _pixel_shuffle_with_an_empty_shard))


def _a_loss_kernel_averaging_over_slabs_raises() -> bool:
    mesh = get_mesh((2,))
    x, y = (distribute_tensor(_x((2, 3, 8, 6), seed=s), mesh, _shard_h(mesh)) for s in (0, 1))
    with pytest.raises(ShardingRuleError, match="reduction='none' and take .mean"):
        torch._C._nn.mse_loss(x, y, 1)  # the kernel under F.mse_loss, which ops/losses.py intercepts
    with pytest.raises(ShardingRuleError, match="divide by each slab's count"):
        torch.ops.aten.huber_loss(x, y)
    torch._C._nn.mse_loss(x, y, 0).mean()  # reduction='none' is elementwise: runs
    return True


def test_a_loss_kernel_averaging_over_slabs_raises():
    """mse_loss_backward run on each slab divided by the slab's count: F.mse_loss's input gradient
    was scaled by the number of ranks, silently.  A loss kernel reached with reduction='mean' over
    a sharded input now raises, naming the fix."""
    assert all(run_on_ranks(2, _a_loss_kernel_averaging_over_slabs_raises))
