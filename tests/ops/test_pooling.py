"""Max, average and adaptive pooling on spatially sharded grids: exact values, indices, gradients and bytes.

Every case runs sharded and on one device (``assert_sharded_matches``: outputs, global
``return_indices`` and input grads) on 1-4 ranks and on a 2x2 mesh (two spatial dims over the
two mesh axes), with balanced, uneven (13 x 7) and skewed splits (one-row and empty shards, so
windows reach past neighbours and some ranks own no output).  Adaptive pools run also where the
output size does not divide a sharded extent (windows of varying size, overlapping), shrinking
and growing, with ties, NaN and -inf for the max pools' indices.  ``check_cases`` and the layout
helpers are shared with ``test_interpolation.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops._local import ShardedOpError
from physics_dp.shard_tensor import Partial, Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.testing import forward_backward_traffic, get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_conv import _sizes
from .test_halo import EXTENTS, LAYOUTS, SPLITS, world_of


# ----- layouts shared with test_interpolation -----------------------------------------------------
def spatial(first, second):
    """Placements: ``first`` over mesh axis 0; on 2-D meshes ``second`` over axis 1."""
    return lambda mesh: [Shard(first)] if mesh.ndim == 1 else [Shard(first), Shard(second)]


hw = spatial(2, 3)


def batch_and_length(mesh):
    """1-D grids (N, C, L): L over a 1-D mesh; the batch over axis 0 and L over axis 1 of a 2-D mesh."""
    return [Shard(2)] if mesh.ndim == 1 else [Shard(0), Shard(2)]


def half_or_global(n: int) -> int:
    """An output extent that splits an extent of ``n`` into equal windows: n/2, or 1 for odd n."""
    return n // 2 if n % 2 == 0 else 1


def check_cases(cases, mesh_shape, split, names) -> int:
    """Run ``cases[name]`` = (factory(h, w), shape(h, w), placements(mesh)) sharded vs one device."""
    mesh = get_mesh(mesh_shape)
    h, w = EXTENTS[split]
    for index, name in enumerate(names):
        factory, shape_of, placements_of = cases[name]
        shape, placements = shape_of(h, w), placements_of(mesh)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(index))
        sizes = _sizes(split, shape, placements, mesh)
        try:
            report = assert_sharded_matches(factory(h, w), [x], mesh, [placements], sharding_sizes=[sizes])
        except Exception as error:
            raise AssertionError(f"{name} on mesh {mesh_shape}, {split} split {sizes}: {error}") from error
        assert all(p == tuple(placements) for p in report.output_placements), f"{name}: {report.output_placements}"
    return len(names)


# name -> (module or fn from (H, W), input shape from (H, W), placements from mesh)
CASES = {
    "max2d_k2": (lambda h, w: nn.MaxPool2d(2), lambda h, w: (2, 3, h, w), hw),
    "max2d_k3_s1_p1": (lambda h, w: nn.MaxPool2d(3, 1, 1), lambda h, w: (2, 3, h, w), hw),
    "max2d_k3_s2_p1_ceil": (lambda h, w: nn.MaxPool2d(3, 2, 1, ceil_mode=True), lambda h, w: (2, 3, h, w), hw),
    "max2d_k2_indices": (lambda h, w: nn.MaxPool2d(2, return_indices=True), lambda h, w: (2, 3, h, w), hw),
    "max2d_k3x2_s2x1_p1x0_d2x1_ceil_indices": (
        lambda h, w: nn.MaxPool2d((3, 2), (2, 1), (1, 0), dilation=(2, 1), ceil_mode=True, return_indices=True),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "max2d_functional_k4_s3_p2": (lambda h, w: (lambda x: F.max_pool2d(x, 4, 3, 2)), lambda h, w: (1, 2, h, w), hw),
    "max2d_unbatched_k3_s2": (lambda h, w: nn.MaxPool2d(3, 2), lambda h, w: (3, h, w), spatial(1, 2)),
    "max2d_w_over_axis0": (lambda h, w: nn.MaxPool2d(3, 2, 1, return_indices=True), lambda h, w: (2, 3, w, h), spatial(3, 2)),
    "max1d_k3_s2_p1_ceil_indices": (
        lambda h, w: nn.MaxPool1d(3, 2, 1, ceil_mode=True, return_indices=True),
        lambda h, w: (2, 3, h),
        batch_and_length,
    ),
    "max1d_k5_p2_d2": (lambda h, w: nn.MaxPool1d(5, 1, 2, dilation=2), lambda h, w: (2, 3, h), batch_and_length),
    "max3d_k2x3x2_s2x1x1_p1x1x0_indices": (
        lambda h, w: nn.MaxPool3d((2, 3, 2), (2, 1, 1), (1, 1, 0), return_indices=True),
        lambda h, w: (1, 2, h, w, 4),
        hw,
    ),
    "max2d_channel_sharded": (lambda h, w: nn.MaxPool2d(3, 2, 1, return_indices=True), lambda h, w: (w, h, 6, 5), spatial(1, 0)),
    "avg2d_k2": (lambda h, w: nn.AvgPool2d(2), lambda h, w: (2, 3, h, w), hw),
    "avg2d_k3_s1_p1": (lambda h, w: nn.AvgPool2d(3, 1, 1), lambda h, w: (2, 3, h, w), hw),
    "avg2d_k3_s2_p1_ceil_exclude_pad": (
        lambda h, w: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "avg2d_k3x2_s2x3_p1_ceil_include_pad": (lambda h, w: nn.AvgPool2d((3, 2), (2, 3), 1, ceil_mode=True), lambda h, w: (2, 3, h, w), hw),
    "avg2d_divisor_override": (lambda h, w: nn.AvgPool2d(3, 2, 1, divisor_override=5), lambda h, w: (2, 3, h, w), hw),
    # no padding: torch's own op on the window (its divisor is the kernel's or the override)
    "avg2d_k3_s2_divisor_override_no_pad": (lambda h, w: nn.AvgPool2d(3, 2, divisor_override=4), lambda h, w: (2, 3, h, w), hw),
    "avg2d_batch_and_h": (lambda h, w: nn.AvgPool2d(3, 1, 1), lambda h, w: (4, 3, h, w), spatial(2, 0)),
    "avg1d_k4_s3_p2_ceil_exclude_pad": (
        lambda h, w: nn.AvgPool1d(4, 3, 2, ceil_mode=True, count_include_pad=False),
        lambda h, w: (2, 3, h),
        batch_and_length,
    ),
    "avg3d_k3_s2_p1_ceil": (lambda h, w: nn.AvgPool3d(3, 2, 1, ceil_mode=True), lambda h, w: (1, 2, h, w, 5), hw),
    "adaptive_avg2d_global": (lambda h, w: nn.AdaptiveAvgPool2d(1), lambda h, w: (2, 3, h, w), hw),
    "adaptive_avg2d_halves": (
        lambda h, w: nn.AdaptiveAvgPool2d((half_or_global(h), half_or_global(w))),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "adaptive_avg3d_whole_dim_uneven": (
        lambda h, w: nn.AdaptiveAvgPool3d((half_or_global(h), None, 3)),
        lambda h, w: (1, 2, h, w, 5),
        hw,
    ),
    "adaptive_max2d_indices": (
        lambda h, w: nn.AdaptiveMaxPool2d((half_or_global(h), None), return_indices=True),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "adaptive_max1d": (lambda h, w: nn.AdaptiveMaxPool1d(half_or_global(h)), lambda h, w: (2, 3, h), batch_and_length),
}


# ----- adaptive pools whose output size does not divide a sharded extent -------------------------
# H is 12 or 13 and W 8 or 7: none of 5, 3, H + 5, W + 3, 2H - 1, ... divides them, so torch's
# windows (rows floor(j*L/O) .. ceil((j+1)*L/O)) vary in size and, growing, overlap.
ADAPTIVE_CASES = {
    "adaptive_avg2d_shrink": (lambda h, w: nn.AdaptiveAvgPool2d((5, 3)), lambda h, w: (2, 3, h, w), hw),
    "adaptive_avg2d_grow": (lambda h, w: nn.AdaptiveAvgPool2d((h + 5, w + 3)), lambda h, w: (2, 3, h, w), hw),
    "adaptive_avg2d_shrink_h_grow_w": (lambda h, w: nn.AdaptiveAvgPool2d((5, 2 * w - 1)), lambda h, w: (1, 2, h, w), hw),
    "adaptive_avg2d_one_dividing_dim": (lambda h, w: nn.AdaptiveAvgPool2d((5, 1)), lambda h, w: (2, 3, h, w), hw),
    "adaptive_avg2d_w_over_axis0": (lambda h, w: nn.AdaptiveAvgPool2d((4, 5)), lambda h, w: (2, 3, w, h), spatial(3, 2)),
    "adaptive_avg1d": (lambda h, w: nn.AdaptiveAvgPool1d(5), lambda h, w: (2, 3, h), batch_and_length),
    "adaptive_avg3d_whole_last_dim": (lambda h, w: nn.AdaptiveAvgPool3d((5, w + 2, 3)), lambda h, w: (1, 2, h, w, 5), hw),
    "adaptive_max2d_shrink": (lambda h, w: (lambda x: F.adaptive_max_pool2d(x, (5, 3))), lambda h, w: (2, 3, h, w), hw),
    "adaptive_max2d_shrink_indices": (
        lambda h, w: nn.AdaptiveMaxPool2d((5, 3), return_indices=True),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "adaptive_max2d_grow_indices": (
        lambda h, w: nn.AdaptiveMaxPool2d((2 * h - 1, w + 3), return_indices=True),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "adaptive_max1d_grow_indices": (
        lambda h, w: (lambda x: F.adaptive_max_pool1d(x, h + 3, return_indices=True)),
        lambda h, w: (2, 3, h),
        batch_and_length,
    ),
    "adaptive_max3d_indices": (
        lambda h, w: nn.AdaptiveMaxPool3d((5, w + 1, 2), return_indices=True),
        lambda h, w: (1, 2, h, w, 5),
        hw,
    ),
    "adaptive_max3d_none_size": (lambda h, w: nn.AdaptiveMaxPool3d((7, None, 3)), lambda h, w: (1, 2, h, w, 4), hw),
    "area_shrink": (lambda h, w: (lambda x: F.interpolate(x, size=(5, 3), mode="area")), lambda h, w: (2, 3, h, w), hw),
    "area_grow_1d": (lambda h, w: (lambda x: F.interpolate(x, size=h + 4, mode="area")), lambda h, w: (2, 3, h), batch_and_length),
}


FAMILIES = {"pools": CASES, "adaptive pools, windows of varying size": ADAPTIVE_CASES}


def _family_cases(family, mesh_shape, split, names):
    return check_cases(FAMILIES[family], mesh_shape, split, names)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_pooling_matches_single_device(mesh_shape, split, family):
    names = sorted(FAMILIES[family])
    world = world_of(mesh_shape)
    assert run_on_ranks(world, _family_cases, family, mesh_shape, split, names, timeout=120) == [len(names)] * world


def _ties_nan_and_empty_shard(mesh_shape, sizes, names):
    """Small integers (many ties), NaN and -inf, on explicit splits with an empty shard."""
    mesh = get_mesh(mesh_shape)
    placements = [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]
    for index, name in enumerate(names):
        fn, shape, _ = ADAPTIVE_CASES[name]
        x = torch.randint(0, 3, shape(7, 9), generator=torch.Generator().manual_seed(index)).float()
        x.view(-1)[::11] = float("nan") if index % 2 else 2.0
        x.view(-1)[5::13] = -float("inf")
        try:
            assert_sharded_matches(fn(7, 9), [x], mesh, [placements], sharding_sizes=[sizes])
        except Exception as error:
            raise AssertionError(f"{name} on mesh {mesh_shape}, split {sizes}: {error}") from error
    return len(names)


@pytest.mark.parametrize(
    "mesh_shape, sizes",
    [((3,), {0: [3, 0, 4]}), ((2,), {0: [6, 1]}), ((4,), {0: [0, 2, 5, 0]}), ((2, 2), {0: [3, 4], 1: [0, 9]})],
    ids=str,
)
def test_adaptive_pools_match_with_ties_nan_and_empty_shards(mesh_shape, sizes):
    # H = 7, W = 9 (H over axis 0, W over axis 1); the 2x2 mesh runs the cases with two spatial dims
    names = sorted(name for name, (_, _, placements) in ADAPTIVE_CASES.items() if placements is hw)
    names += [] if len(mesh_shape) == 2 else sorted(name for name, (_, _, p) in ADAPTIVE_CASES.items() if p is batch_and_length)
    world = world_of(mesh_shape)
    assert run_on_ranks(world, _ties_nan_and_empty_shard, mesh_shape, sizes, names, timeout=120) == [len(names)] * world


# ----- communication ------------------------------------------------------------------------------
def _pool_bytes(mesh_shape, pool, shape):
    """(coordinate, forward records, backward records) of a pool on (N, C, H, W) sharded on H (and W)."""
    mesh = get_mesh(mesh_shape)
    x = distribute_tensor(torch.randn(shape), mesh, hw(mesh)).requires_grad_(True)
    return (tuple(mesh.get_coordinate()), *forward_backward_traffic(pool, x))


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_aligned_two_by_two_pool_sends_nothing(mesh_shape):
    # H = 16 and W = 8 split in even, even-sized shards: every window lies inside one slab
    for pool in (nn.MaxPool2d(2), nn.AvgPool2d(2)):
        for coordinate, forward, backward in run_on_ranks(world_of(mesh_shape), _pool_bytes, mesh_shape, pool, (2, 3, 16, 8)):
            assert forward == [] and backward == [], (pool, coordinate, forward, backward)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_three_by_three_pool_sends_one_halo_row_to_each_neighbour(world):
    row = 2 * 3 * 8 * 4  # N * C * W float32
    for pool in (nn.MaxPool2d(3, 1, 1), nn.AvgPool2d(3, 1, 1, count_include_pad=False)):
        for (c,), forward, backward in run_on_ranks(world, _pool_bytes, (world,), pool, (2, 3, 12, 8)):
            neighbours = (c > 0) + (c < world - 1)
            assert forward == [("p2p", row)] * neighbours, (pool, c, forward)
            assert backward == [("p2p", row)] * neighbours, (pool, c, backward)


def _graph_nodes(pool):
    """The autograd node names between a pool's output and its H-sharded input."""
    mesh = get_mesh((2,))
    x = distribute_tensor(torch.randn(2, 3, 12, 8), mesh, [Shard(2)]).requires_grad_(True)
    names, stack, visited = [], [pool(x).grad_fn], []  # visited keeps the node wrappers alive, so ids stay unique
    while stack:
        node = stack.pop()
        if node is None or any(node is seen for seen in visited):
            continue
        visited.append(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_pool_takes_no_slice_of_the_slab_along_a_whole_dim():
    # a slice's backward zero-fills a tensor of the slab's size and copies the gradient into it
    for pool in (nn.AvgPool2d(2), nn.MaxPool2d(3, 1, 1)):
        for names in run_on_ranks(2, _graph_nodes, pool):
            assert not any(name.startswith(("SliceBackward", "NarrowBackward")) for name in names), (pool, names)


def test_an_aligned_pool_builds_no_window_gather_node():
    # every window inside its own slab: no rows move, so no gather Function (forward and backward) either
    for names in run_on_ranks(2, _graph_nodes, nn.AvgPool2d(2)):
        assert not any(name.startswith("_GatherWindow") for name in names), names
    for names in run_on_ranks(2, _graph_nodes, nn.MaxPool2d(3, 1, 1)):  # a halo: the gather stays
        assert any(name.startswith("_GatherWindow") for name in names), names


def test_pool_on_2x2_mesh_sends_rows_then_columns_with_corners():
    # (2, 3, 12, 8) split 6+6 over H and 4+4 over W, k=3 s=1 p=1: one row of N*C*4, then one
    # column of N*C*(6 + 1 halo row); rows beyond the grid are filled locally, never sent.
    for coordinate, forward, backward in run_on_ranks(4, _pool_bytes, (2, 2), nn.MaxPool2d(3, 1, 1), (2, 3, 12, 8)):
        assert forward == [("p2p", 2 * 3 * 4 * 4), ("p2p", 2 * 3 * 7 * 4)], (coordinate, forward)
        assert sorted(backward) == sorted(forward), (coordinate, backward)


def _empty_adaptive_outputs():
    mesh = get_mesh((3,))
    x = torch.randn(2, 3, 7, 9)
    for size in ((0, 4), (5, 0)):  # torch's backward refuses empty outputs: forward only
        for pool in (nn.AdaptiveAvgPool2d(size), nn.AdaptiveMaxPool2d(size, return_indices=True)):
            assert_sharded_matches(pool, [x], mesh, [[Shard(2)]], sharding_sizes=[{0: [3, 0, 4]}], check_grads=False)
    return True


def test_adaptive_pools_to_an_empty_output():
    assert all(run_on_ranks(3, _empty_adaptive_outputs))


def _values(pool, x):
    out = pool(x)
    return out[0] if isinstance(out, tuple) else out


# sends: sending rank -> the ranks it sends a row to in forward
@pytest.mark.parametrize("out, sends", [(5, {1: (0, 2)}), (16, {1: (0,), 2: (1,)})], ids=["shrink", "grow"])
def test_adaptive_pool_sends_only_rows_its_windows_read(out, sends):
    # H = 12 in 4 + 4 + 4.  To 5 outputs the windows are rows [0,3) [2,5) [4,8) [7,10) [9,12),
    # owned by the owners of their centre rows 1 3 5 8 10 (2 + 1 + 2 outputs): rank 1 sends row 4
    # to rank 0 and row 7 to rank 2.  To 16, rank 0 reads rows [0,5) and rank 1 rows [4,9):
    # ranks 1 and 2 send one row each.  Gradients of those rows travel back; nothing else moves.
    row = 2 * 3 * 8 * 4  # N * C * W float32
    for pool in (nn.AdaptiveAvgPool2d((out, 8)), nn.AdaptiveMaxPool2d((out, 3), return_indices=True)):
        for (c,), forward, backward in run_on_ranks(3, _pool_bytes, (3,), functools.partial(_values, pool), (2, 3, 12, 8)):
            assert forward == [("p2p", row)] * len(sends.get(c, ())), (pool, c, forward)
            received = sum(c in receivers for receivers in sends.values())
            assert backward == [("p2p", row)] * received, (pool, c, backward)


# ----- unsupported combinations and invalid arguments ---------------------------------------------
def _unsupported_raise():
    mesh = get_mesh((2,))
    x = torch.randn(2, 3, 13, 8)
    with pytest.raises(ShardedOpError) as info:
        F.max_pool2d(ShardTensor.from_local(x, mesh, [Partial("sum")]), 2)
    return str(info.value)


def test_unsupported_combinations_raise_naming_op_placements_and_reason():
    partial = run_on_ranks(2, _unsupported_raise)[0]
    assert partial.startswith("max_pool2d") and "Partial" in partial and "redistribute" in partial


def _invalid_arguments_raise_like_torch():
    mesh = get_mesh((2,))
    x = distribute_tensor(torch.randn(1, 3, 8, 8), mesh, [Shard(2)])
    with pytest.raises(RuntimeError, match="pad should be at most half"):
        F.max_pool2d(x, 2, padding=2)
    with pytest.raises(RuntimeError, match="divisor must be not zero"):
        F.avg_pool2d(x, 2, divisor_override=0)
    return True


def test_invalid_arguments_raise_torch_errors():
    assert all(run_on_ranks(2, _invalid_arguments_raise_like_torch))


def _replicated_axis_and_batch_only():
    """A replicated mesh axis beside a sharded H, and a batch-only split (pooled locally)."""
    mesh = get_mesh((2, 2))
    x = torch.randn(4, 3, 13, 7)
    assert_sharded_matches(nn.MaxPool2d(3, 2, 1, return_indices=True), [x], mesh, [[Shard(2), Replicate()]])
    with count_communication() as log:
        assert_sharded_matches(nn.AvgPool2d(3, 2, 1), [x], mesh, [[Shard(0), Replicate()]], check_grads=False)
    return log.kinds()


def test_replicated_axes_and_batch_only_splits():
    for kinds in run_on_ranks(4, _replicated_axis_and_batch_only):
        assert "p2p" not in kinds  # the batch-only pool ran on the slabs; full_tensor gathers only
