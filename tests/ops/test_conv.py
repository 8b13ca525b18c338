"""Convolutions and transposed convolutions on spatially sharded grids: exact, with exact halo bytes.

Every case runs sharded and on one device (``assert_sharded_matches``: outputs, input grads and
parameter grads) on 1-4 ranks and on a 2x2 mesh (two spatial dims over the two mesh axes), with
balanced, uneven and skewed splits (one-row and empty shards, so halos reach past neighbours).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops._local import ShardedOpError
from physics_dp.ops.conv import conv_output_split, transposed_output_split
from physics_dp.ops.halo import with_extent
from physics_dp.shard_tensor import Partial, Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.testing import forward_backward_traffic, get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_halo import EXTENTS, LAYOUTS, SKEWED_H, SKEWED_W, SPLITS, window_gather_forbidden, world_of


class UpsampleTo(nn.Module):
    """A transposed conv asked for an output size (torch derives output_padding from global shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x, output_size=[2 * x.shape[2], 2 * x.shape[3]])


def _spatial_1d(mesh):
    """Placements for (N, C, L): L over the mesh (over axis 1 on 2-D meshes, batch over axis 0)."""
    return [Shard(2)] if mesh.ndim == 1 else [Shard(0), Shard(2)]


def _spatial(first, second):
    """First sharded dim over axis 0; on 2-D meshes the second over axis 1."""
    return lambda mesh: [Shard(first)] if mesh.ndim == 1 else [Shard(first), Shard(second)]


def _hw(mesh):
    return _spatial(2, 3)(mesh)


def _grid(factory, n=2, c=3):
    """A case on an (n, c, H, W) field sharded over H (and W on 2-D meshes)."""
    return factory, lambda h, w: [(n, c, h, w)], _hw


def _line(factory):
    """A case on an (2, 3, L) signal: L over 1-D meshes; batch x L on 2-D meshes."""
    return factory, lambda h, w: [(2, 3, h)], _spatial_1d


# name -> (module or fn factory, input shapes from (H, W), placements from mesh)
# In the shapes, H and W are the extents of the split under test; dims sharded on axis 0 get H.
CASES = {
    "conv2d_k3_p1": _grid(lambda: nn.Conv2d(3, 4, 3, padding=1)),
    "conv2d_k3_s2_p1": _grid(lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1)),
    "conv2d_k2_s2_patchify": _grid(lambda: nn.Conv2d(3, 4, 2, stride=2)),
    "conv2d_k4_same_dil2": _grid(lambda: nn.Conv2d(3, 4, 4, padding="same", dilation=2)),
    "conv2d_k5_valid_nobias": _grid(lambda: nn.Conv2d(3, 2, 5, padding="valid", bias=False), n=1),
    "conv2d_k3x5_s2x1_p0x2_d1x2": _grid(
        lambda: nn.Conv2d(3, 4, (3, 5), stride=(2, 1), padding=(0, 2), dilation=(1, 2))
    ),
    "conv2d_groups3": _grid(lambda: nn.Conv2d(6, 9, 3, padding=1, groups=3), n=1, c=6),
    "conv2d_depthwise_k5": _grid(lambda: nn.Conv2d(4, 4, 5, padding=2, groups=4), n=1, c=4),
    "conv2d_1x1": _grid(lambda: nn.Conv2d(3, 5, 1)),
    "conv2d_k3_s3_p2_d2": _grid(lambda: nn.Conv2d(3, 4, 3, stride=3, padding=2, dilation=2)),
    "conv2d_k1_s2_p2": _grid(lambda: nn.Conv2d(3, 4, 1, stride=2, padding=2), n=1),
    "conv2d_reflect": _grid(lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect")),
    "conv2d_circular": _grid(lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")),
    "conv2d_replicate_s2": _grid(lambda: nn.Conv2d(3, 4, 4, stride=2, padding=(2, 1), padding_mode="replicate")),
    "conv2d_functional_same_plain_weight": (
        lambda: (lambda x, weight, bias: F.conv2d(x, weight, bias, padding="same")),
        lambda h, w: [(2, 3, h, w), (4, 3, 2, 3), (4,)],
        lambda mesh: [_hw(mesh), None, None],
    ),
    "conv2d_w_over_axis0_h_over_axis1": (
        lambda: nn.Conv2d(3, 4, 3, padding=1),
        lambda h, w: [(2, 3, w, h)],
        _spatial(3, 2),
    ),
    "conv2d_batch_and_h": (
        lambda: nn.Conv2d(3, 4, 3, padding=1),
        lambda h, w: [(4, 3, h, w)],
        lambda mesh: [Shard(2)] if mesh.ndim == 1 else [Shard(0), Shard(2)],
    ),
    "conv2d_replicated_axis": (
        lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1),
        lambda h, w: [(2, 3, h, w)],
        lambda mesh: [Shard(2)] if mesh.ndim == 1 else [Shard(2), Replicate()],
    ),
    "conv2d_batch_only": (
        lambda: nn.Conv2d(3, 4, 3, padding=1),
        lambda h, w: [(h, 3, 6, 5)],
        lambda mesh: [Shard(0)] if mesh.ndim == 1 else [Shard(0), Replicate()],
    ),
    "conv2d_unbatched": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), lambda h, w: [(3, h, w)], _spatial(1, 2)),
    "conv2d_unbatched_same": (lambda: nn.Conv2d(3, 4, 3, padding=1), lambda h, w: [(3, h, w)], _spatial(1, 2)),
    "conv_transpose2d_k3_s2_p1_op1": _grid(lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)),
    "conv_transpose2d_output_size": _grid(UpsampleTo, n=1),
    "conv_transpose2d_k2_s2": _grid(lambda: nn.ConvTranspose2d(3, 4, 2, stride=2)),
    "conv_transpose2d_k4_s2_p1_groups": _grid(lambda: nn.ConvTranspose2d(3, 6, 4, stride=2, padding=1, groups=3), n=1),
    "conv_transpose2d_k1_s3_p1_gaps": _grid(lambda: nn.ConvTranspose2d(3, 4, 1, stride=3, padding=1), n=1),
    "conv_transpose2d_k3_d2_p1_nobias": _grid(lambda: nn.ConvTranspose2d(3, 4, 3, padding=1, dilation=2, bias=False)),
    "conv_transpose2d_k3x2_s3x2_p1x0_op2x1": _grid(
        lambda: nn.ConvTranspose2d(3, 2, (3, 2), stride=(3, 2), padding=(1, 0), output_padding=(2, 1)), n=1
    ),
    "conv_transpose2d_functional": (
        lambda: (lambda x, weight: F.conv_transpose2d(x, weight, stride=(2, 3), padding=(2, 1), dilation=(2, 1))),
        lambda h, w: [(2, 3, h, w), (3, 2, 3, 4)],
        lambda mesh: [_hw(mesh), None],
    ),
    "conv1d_k3_p1": _line(lambda: nn.Conv1d(3, 4, 3, padding=1)),
    "conv1d_k5_s2_p2": _line(lambda: nn.Conv1d(3, 4, 5, stride=2, padding=2)),
    "conv1d_circular_same": _line(lambda: nn.Conv1d(3, 4, 4, padding="same", padding_mode="circular")),
    "conv_transpose1d_k3_s2_p1_op1": _line(lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1)),
    "conv3d_k3_p1_depth": (lambda: nn.Conv3d(2, 3, 3, padding=1), lambda h, w: [(1, 2, h, w, 4)], _spatial(2, 3)),
    "conv3d_k312_s211_width": (
        lambda: nn.Conv3d(2, 3, (3, 1, 2), stride=(2, 1, 1), padding=(1, 0, 0)),
        lambda h, w: [(1, 2, 4, w, h)],
        _spatial(4, 3),
    ),
    "conv_transpose3d_k2_s2": (
        lambda: nn.ConvTranspose3d(2, 3, 2, stride=2),
        lambda h, w: [(1, 2, h, w, 3)],
        _spatial(2, 3),
    ),
    "conv_transpose3d_k3_s2_p1_hw": (
        lambda: nn.ConvTranspose3d(2, 2, 3, stride=(1, 2, 2), padding=1, output_padding=(0, 1, 0)),
        lambda h, w: [(1, 2, 3, h, w)],
        _spatial(3, 4),
    ),
}


def _sizes(kind, shape, placements, mesh):
    """The split of every sharded axis: balanced, or skewed (one-row and empty shards)."""
    if kind != "skewed":
        return None
    table = (SKEWED_H, SKEWED_W)
    sizes = {}
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard) and mesh.size(axis) > 1:
            skew = table[axis].get(mesh.size(axis), table[0][mesh.size(axis)])
            sizes[axis] = skew(shape[placement.dim])
    return sizes


def _conv_cases(mesh_shape, split, names):
    mesh = get_mesh(mesh_shape)
    h, w = EXTENTS[split]
    for index, name in enumerate(names):
        factory, shapes_of, placements_of = CASES[name]
        shapes = shapes_of(h, w)
        generator = torch.Generator().manual_seed(index)
        inputs = [torch.randn(shape, generator=generator) for shape in shapes]
        placements = placements_of(mesh)
        placements = placements if isinstance(placements[0], (list, type(None))) else [placements]
        placements += [None] * (len(inputs) - len(placements))
        sizes = [None if p is None else _sizes(split, shape, p, mesh) for p, shape in zip(placements, shapes)]
        torch.manual_seed(index)
        fn = factory()
        try:
            report = assert_sharded_matches(fn, inputs, mesh, placements, sharding_sizes=sizes)
        except Exception as error:
            raise AssertionError(f"{name} on mesh {mesh_shape}, {split} split {sizes}: {error}") from error
        assert report.output_placements == [tuple(placements[0])], f"{name}: {report.output_placements}"
    return len(names)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_conv_family_matches_single_device(mesh_shape, split):
    names = sorted(CASES)
    world = world_of(mesh_shape)
    assert run_on_ranks(world, _conv_cases, mesh_shape, split, names, timeout=120) == [len(names)] * world


# ----- exact output splits ----------------------------------------------------------------------
def test_output_splits_keep_same_convolutions_aligned_and_strided_ones_exact():
    # stride 1 'same' (k=3, p=1; k=4 'same' pads 1 left): the input split is kept
    # arguments: split, output extent, kernel, stride, dilation, leading padding
    assert conv_output_split((5, 0, 8), 13, 3, 1, 1, 1) == (5, 0, 8)
    assert conv_output_split((5, 0, 8), 13, 4, 1, 1, 1) == (5, 0, 8)
    # stride 2 over odd shards: output j belongs to the owner of row 2j (k=3, p=1)
    assert conv_output_split((3, 3, 3, 3), 6, 3, 2, 1, 1) == (2, 1, 2, 1)
    # 'valid' k=3: output j is centred on row j+1
    assert conv_output_split((1, 12), 11, 3, 1, 1, 0) == (0, 11)
    # transposed k=2 s=2 and k=4 s=2 p=1: every input row yields exactly two outputs
    assert transposed_output_split((3, 4, 0), 14, 2, 2, 1, 0) == (6, 8, 0)
    assert transposed_output_split((3, 4, 0), 14, 4, 2, 1, 1) == (6, 8, 0)


# ----- communication ------------------------------------------------------------------------------
def _conv_bytes(mesh_shape, kernel, stride, padding, h_sizes=None):
    """Bytes each rank sends in a conv2d's forward and backward, by kind."""
    mesh = get_mesh(mesh_shape)
    placements = [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]
    sizes = None if h_sizes is None else {0: h_sizes}
    x = distribute_tensor(torch.randn(2, 3, 12, 8), mesh, placements, sharding_sizes=sizes).requires_grad_(True)
    conv = nn.Conv2d(3, 4, kernel, stride=stride, padding=padding)
    return (tuple(mesh.get_coordinate()), *forward_backward_traffic(conv, x))


def _p2p(records):
    return sorted(b for kind, b in records if kind == "p2p")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv_halo_sends_exactly_the_halo_rows(world):
    row = 2 * 3 * 8 * 4  # N * C_in * W float32
    # the copy-free path sends the output gradient's boundary row back (N * C_out * W)
    grad_row = 2 * 4 * 8 * 4
    # the weight and bias shares are summed in one bucket at the end of backward
    weight_and_bias = [("all_reduce", (4 * 3 * 3 * 3 + 4) * 4)]
    for (c,), forward, backward in run_on_ranks(world, _conv_bytes, (world,), 3, 1, 1):
        neighbours = (c > 0) + (c < world - 1)
        assert forward == [("p2p", row)] * neighbours, (c, forward)
        assert _p2p(backward) == [grad_row] * neighbours, (c, backward)
        assert sorted(r for r in backward if r[0] != "p2p") == sorted(weight_and_bias), (c, backward)


def test_conv_halo_of_two_rows_and_a_strided_conv():
    row = 2 * 3 * 8 * 4
    for (c,), forward, _ in run_on_ranks(3, _conv_bytes, (3,), 5, 1, 2):
        assert forward == [("p2p", 2 * row)] * ((c > 0) + (c < 2)), (c, forward)
    # 12 rows on 4 ranks, k=3 s=2 p=1: outputs split (2, 1, 2, 1); rank 0 needs row 3, rank 2 rows 5 and 9
    sent = {c: _p2p(forward) for (c,), forward, _ in run_on_ranks(4, _conv_bytes, (4,), 3, 2, 1)}
    assert sent == {0: [], 1: [row, row], 2: [], 3: [row]}


def test_conv_halo_on_2x2_mesh_sends_rows_then_columns_with_corners():
    # (2, 3, 12, 8) split 6+6 over H (axis 0) and 4+4 over W (axis 1), k=3 p=1:
    # H exchange: one row of N*C*4; W exchange: one column of N*C*(6 + 1 halo row), no padding rows.
    for coordinate, forward, _ in run_on_ranks(4, _conv_bytes, (2, 2), 3, 1, 1):
        assert forward == [("p2p", 2 * 3 * 4 * 4), ("p2p", 2 * 3 * 7 * 4)], (coordinate, forward)


def _transposed_bytes(world):
    """Bytes each rank sends in a 4x4 stride-2 padding-1 transposed conv (an upsampling layer) and its backward."""
    mesh = get_mesh((world,))
    x = distribute_tensor(torch.randn(2, 3, 4 * world, 8), mesh, [Shard(2)]).requires_grad_(True)
    up = nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1)
    return (tuple(mesh.get_coordinate()), *forward_backward_traffic(up, x))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_upsampling_transposed_conv_sends_one_row_each_way(world):
    # forward: one input row to each neighbour (N * C_in * W); backward: one output-gradient row (N * C_out * 2W)
    row, grad_row = 2 * 3 * 8 * 4, 2 * 4 * 16 * 4
    for (c,), forward, backward in run_on_ranks(world, _transposed_bytes, world):
        neighbours = (c > 0) + (c < world - 1)
        assert forward == [("p2p", row)] * neighbours, (c, forward)
        assert _p2p(backward) == [grad_row] * neighbours, (c, backward)


def _upsampling_on_the_slab(world, name):
    """Transposed convs whose output split is stride x the input split, with the window gather (a copy of the slab) forbidden."""
    import physics_dp.ops.conv as conv

    # the layer, the global input shape, the placement, and the smallest shard whose halos reach only the neighbours
    factory, shape, dim, small = {
        "k4_s2_p1": (lambda: nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1), (2, 3, 3 * world + 2, 5), 2, 1),
        "k2_s2_nobias": (lambda: nn.ConvTranspose2d(3, 4, 2, stride=2, bias=False), (2, 3, 2 * world + 1, 5), 3, 1),
        "k3_s2_p1_op1_groups": (
            lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (1, 4, 3 * world, 6), 2, 1,
        ),
        "k5_s2_p2_op1_1d": (lambda: nn.ConvTranspose1d(3, 2, 5, stride=2, padding=2, output_padding=1), (2, 3, 4 * world + 3), 2, 1),
        "k6_d2_s2_p5_halo_rows_skip_a_row": (
            lambda: nn.ConvTranspose2d(2, 3, 6, stride=2, padding=5, output_padding=1, dilation=2), (1, 2, 3 * world + 1, 4), 2, 3,
        ),
        "k3_d2_s3_p2_3d": (
            lambda: nn.ConvTranspose3d(2, 3, 3, stride=3, padding=2, dilation=2, output_padding=2), (1, 2, 3, 3 * world + 1, 4), 3, 2,
        ),
    }[name]
    mesh = get_mesh((world,))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    sizes = [{0: [small] * (world - 1) + [shape[dim] - small * (world - 1)]}]  # uneven, small shards
    with window_gather_forbidden(conv, "_gather_sharded"):
        for split in (sizes, None):  # a fresh layer each time: parameter gradients accumulate
            torch.manual_seed(0)
            assert_sharded_matches(factory(), [x], mesh, [[Shard(dim)]], sharding_sizes=split)
    return True


@pytest.mark.parametrize(
    "name", ["k4_s2_p1", "k2_s2_nobias", "k3_s2_p1_op1_groups", "k5_s2_p2_op1_1d", "k6_d2_s2_p5_halo_rows_skip_a_row", "k3_d2_s3_p2_3d"]
)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_upsampling_transposed_convs_run_on_the_slab_without_copying_it(world, name):
    assert all(run_on_ranks(world, _upsampling_on_the_slab, world, name))


def _strided_on_the_slab(world, name):
    """Strided 'same'-padded convs (and one-row kernels) over shards that are multiples of the stride
    (the last one need not be), with the window gather forbidden."""
    import physics_dp.ops.conv as conv

    # the layer, the global input shape with the sharded extent set to 0, the sharded dim, its stride,
    # and the smallest shard (a multiple of the stride holding the halo)
    factory, shape, dim, stride, small = {
        "k3_s2_p1": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 0, 5), 2, 2, 2),
        "k5_s2_p2_halo_after": (lambda: nn.Conv2d(3, 4, 5, stride=2, padding=2, bias=False), (1, 3, 0, 6), 2, 2, 2),
        "k3_d2_s2_p2_halo_row_skipped": (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=2, dilation=2), (1, 2, 0, 5), 2, 2, 2),
        "k9_s2_p4_zeros_around_halos": (lambda: nn.Conv2d(2, 3, 9, stride=2, padding=4), (1, 2, 0, 3), 2, 2, 4),
        "k7_s3_p3_groups": (lambda: nn.Conv2d(4, 6, 7, stride=3, padding=3, groups=2), (1, 4, 0, 4), 2, 3, 3),
        "k4_d2_s2_p3_width": (lambda: nn.Conv2d(2, 3, (3, 4), stride=(1, 2), padding=(1, 3), dilation=(1, 2)), (1, 2, 5, 0), 3, 2, 4),
        "k1_pointwise": (lambda: nn.Conv2d(3, 4, 1), (2, 3, 0, 5), 2, 1, 1),
        "k1_s2_no_halo": (lambda: nn.Conv2d(3, 4, 1, stride=2, bias=False), (1, 3, 0, 4), 2, 2, 2),
        "k5_s4_p2_1d": (lambda: nn.Conv1d(3, 2, 5, stride=4, padding=2), (2, 3, 0), 2, 4, 4),
        "k3_s2_p1_3d": (lambda: nn.Conv3d(2, 3, 3, stride=2, padding=1), (1, 2, 3, 0, 4), 3, 2, 2),
    }[name]
    mesh = get_mesh((world,))
    generator = torch.Generator().manual_seed(5)
    with window_gather_forbidden(conv, "_gather_sharded"):
        # balanced shards of 2 strides each; then the smallest shards and a last one that is no multiple
        for extent, split in ((2 * stride * world, None), (2 * stride * world + 1, "uneven")):
            x = torch.randn(with_extent(shape, dim, extent), generator=generator)
            sizes = None if split is None else [{0: [small] * (world - 1) + [extent - small * (world - 1)]}]
            torch.manual_seed(0)  # a fresh layer each time: parameter gradients accumulate
            assert_sharded_matches(factory(), [x], mesh, [[Shard(dim)]], sharding_sizes=sizes)
    return True


@pytest.mark.parametrize(
    "name",
    [
        "k3_s2_p1", "k5_s2_p2_halo_after", "k3_d2_s2_p2_halo_row_skipped", "k9_s2_p4_zeros_around_halos", "k7_s3_p3_groups",
        "k4_d2_s2_p3_width", "k1_pointwise", "k1_s2_no_halo", "k5_s4_p2_1d", "k3_s2_p1_3d",
    ],
)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_strided_convs_run_on_the_slab_without_copying_it(world, name):
    assert all(run_on_ranks(world, _strided_on_the_slab, world, name))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_strided_conv_sends_one_row_forward_and_one_gradient_row_back(world):
    # k=3 s=2 p=1 over 12 rows in even shards: a slab's last row reaches the next rank's first output
    # (nothing reaches back), and that output's gradient row returns
    row, grad_row = 2 * 3 * 8 * 4, 2 * 4 * 4 * 4
    sizes = {2: [6, 6], 3: [4, 4, 4], 4: [4, 2, 4, 2]}[world]
    for (c,), forward, backward in run_on_ranks(world, _conv_bytes, (world,), 3, 2, 1, sizes):
        assert forward == [("p2p", row)] * (c < world - 1), (c, forward)
        assert _p2p(backward) == [grad_row] * (c > 0), (c, backward)


def _graph_nodes(tensor: torch.Tensor) -> set[str]:
    seen, frontier = set(), [tensor.grad_fn]
    while frontier:
        node = frontier.pop()
        if node is not None and node.name() not in seen:
            seen.add(node.name())
            frontier.extend(next_node for next_node, _ in node.next_functions)
    return seen


def _one_by_one_sends_nothing(world, stride):
    mesh = get_mesh((world,))
    x = distribute_tensor(torch.randn(2, 3, 12, 4), mesh, [Shard(2)]).requires_grad_(True)
    with count_communication() as forward:
        y = nn.Conv2d(3, 4, 1, stride=stride)(x)
    with count_communication() as backward:
        y.backward(torch.ones_like(y))
    return forward.calls, backward.kinds(), _graph_nodes(y)


@pytest.mark.parametrize("stride", [1, 2])
def test_one_by_one_conv_sends_nothing_and_runs_torchs_own_op(stride):
    """A kernel of one row along the sharded dim reads no neighbour: torch's convolution and its
    backward node on the slab, not the halo Function (a 1x1 forward through it: 372 us cold, now 176)."""
    for calls, backward, nodes in run_on_ranks(3, _one_by_one_sends_nothing, 3, stride):
        assert calls == 0
        assert backward == ["all_reduce"]  # weight and bias gradients only, in one bucket
        assert "ConvolutionBackward0" in nodes and not any("HaloConv" in node for node in nodes), nodes


def _halo_output_nodes(world):
    mesh = get_mesh((world,))
    x = distribute_tensor(torch.randn(2, 3, 12, 4), mesh, [Shard(2)]).requires_grad_(True)
    h = x * 1.5  # an activation, as in a network
    layers = (nn.Conv2d(3, 4, 3, padding=1), nn.ConvTranspose2d(3, 4, 4, 2, 1), nn.Upsample(scale_factor=2, mode="bilinear"))
    return [(type(node).__name__, type(node.next_functions[0][0]).__name__) for node in (layer(h).grad_fn for layer in layers)]


def test_a_halo_convolution_is_one_autograd_node():
    """The halo Functions take their input ShardTensor whole and return their output ShardTensor
    themselves, as the norms do: no conversion node before or after them, each of which cost tens
    of microseconds per op forward and again backward."""
    for nodes in run_on_ranks(3, _halo_output_nodes, 3):
        functions = ["_HaloConvBackward", "_HaloConvTransposeBackward", "_HaloResampleBackward"]
        assert nodes == [(function, "MulBackward0") for function in functions], nodes


# ----- unsupported layouts ------------------------------------------------------------------------
def _unsupported_layouts_raise():
    mesh = get_mesh((2,))
    x = torch.randn(2, 4, 6, 5)
    conv = nn.Conv2d(4, 4, 3, padding=1)
    messages = []
    channel = distribute_tensor(x, mesh, [Shard(1)])
    with pytest.raises(ShardedOpError) as info:
        conv(channel)
    messages.append(str(info.value))
    partial = ShardTensor.from_local(x, mesh, [Partial("sum")])
    with pytest.raises(ShardedOpError) as info:
        F.conv_transpose2d(partial, torch.randn(4, 2, 3, 3))
    messages.append(str(info.value))
    sharded_weight = distribute_tensor(torch.randn(4, 4, 3, 3), mesh, [Shard(0)])
    with pytest.raises(ShardedOpError) as info:
        F.conv2d(distribute_tensor(x, mesh, [Shard(2)]), sharded_weight)
    messages.append(str(info.value))
    with pytest.raises(ShardedOpError) as info:
        F.pad(partial, (1, 1))
    messages.append(str(info.value))
    return messages


def test_unsupported_layouts_raise_naming_op_placements_and_reason():
    channel, partial, weight, pad = run_on_ranks(2, _unsupported_layouts_raise)[0]
    assert "conv2d" in channel and "Shard(dim=1)" in channel and "channel dim 1" in channel and "Replicate" in channel
    assert "conv_transpose2d" in partial and "Partial" in partial and "redistribute" in partial
    assert "conv2d" in weight and "Shard(dim=0)" in weight and "replicated" in weight
    assert pad.startswith("pad") and "Partial" in pad


def _invalid_arguments_raise_like_torch():
    mesh = get_mesh((2,))
    x = distribute_tensor(torch.randn(1, 3, 8, 8), mesh, [Shard(2)])
    with pytest.raises(RuntimeError, match="not supported for strided"):
        F.conv2d(x, torch.randn(4, 3, 3, 3), padding="same", stride=2)
    with pytest.raises(RuntimeError, match="Padding size should be less"):
        F.pad(x, (0, 0, 8, 0), mode="reflect")
    return True


def test_invalid_arguments_raise_torch_errors():
    assert all(run_on_ranks(2, _invalid_arguments_raise_like_torch))


# ----- the copy-free 'same' path: only the gradients asked for --------------------------------------
def _gradients_asked_for(world: int) -> list[str]:
    """(3, 19) rows over ``world`` ranks, uneven: each grad subset equals one device; no input grad, no p2p back."""
    mesh = get_mesh((world,))
    torch.manual_seed(0)
    full = torch.randn(2, 4, 19, 6)
    conv = nn.Conv2d(4, 6, 5, padding=2, groups=2)
    outcomes = []
    for input_grad, weight_grad in ((True, False), (False, True), (True, True)):
        conv.zero_grad()
        for p in conv.parameters():
            p.requires_grad_(weight_grad)
        reference = full.clone().requires_grad_(input_grad)
        expected = conv(reference)
        expected.square().sum().backward()
        reference_weight = None if conv.weight.grad is None else conv.weight.grad.clone()
        conv.zero_grad()
        x = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_(input_grad)
        y = conv(x)
        with count_communication() as backward:
            y.square().sum().backward()
        torch.testing.assert_close(y.full_tensor(), expected.detach(), atol=1e-5, rtol=1e-5)
        if input_grad:
            torch.testing.assert_close(x.grad.full_tensor(), reference.grad, atol=1e-5, rtol=1e-5)
        else:
            assert "p2p" not in backward.kinds(), backward.kinds()
        if weight_grad:
            torch.testing.assert_close(conv.weight.grad, reference_weight, atol=1e-4, rtol=1e-5)
        outcomes.append(f"input={input_grad} weight={weight_grad}")
    return outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_same_conv_computes_only_the_gradients_asked_for(world):
    assert len(run_on_ranks(world, _gradients_asked_for, world)[0]) == 3


def _same_conv_under_autocast(transposed: bool) -> float:
    """bf16 autocast (the trainer's "none"/DDP precision): the copy-free paths cast like F.conv2d."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    conv = nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1) if transposed else nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 12, 8)
    xs = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_(True)
    reference = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys, y = conv(xs), conv(reference)
    assert ys.dtype == y.dtype == torch.bfloat16
    torch.testing.assert_close(ys.full_tensor(), y, atol=2e-2, rtol=2e-2)
    ys.float().square().mean().backward()
    sharded_weight_grad = conv.weight.grad.clone()
    conv.zero_grad()
    y.float().square().mean().backward()
    assert xs.grad.dtype == torch.float32 and sharded_weight_grad.dtype == torch.float32
    torch.testing.assert_close(xs.grad.full_tensor(), reference.grad, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(sharded_weight_grad, conv.weight.grad, atol=2e-3, rtol=2e-2)
    return float((sharded_weight_grad - conv.weight.grad).abs().max())


@pytest.mark.parametrize("transposed", [False, True])
def test_same_conv_under_bf16_autocast_matches_one_device(transposed):
    run_on_ranks(2, _same_conv_under_autocast, transposed)
