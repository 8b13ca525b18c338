"""``F.unfold`` over sharded spatial dims equals one device, forward and backward, sends only halo
rows, and keeps the output sharded (DTensor has no rule for ``im2col``: it raised before)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops.halo_unfold import halo_unfold_geometry
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.shard_tensor.placements import StridedShard
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_shape_ops import LAYOUTS, check_family, randn, world_of

FAMILY: dict[str, Callable] = {
    "unfold(3, padding=1)": lambda x: F.unfold(x, 3, padding=1),
    "unfold((3, 2), dilation=(1, 2), padding=(1, 0), stride=(2, 1))": lambda x: F.unfold(
        x, (3, 2), dilation=(1, 2), padding=(1, 0), stride=(2, 1)
    ),
    "unfold(2, stride=2), patches": lambda x: F.unfold(x, 2, stride=2),
    "nn.Unfold(kernel_size=(1, 3), padding=(0, 2)), then a channel mix": lambda x: nn.Unfold((1, 3), padding=(0, 2))(x).sum(1),
    "unfold of an unbatched (C, H, W) input": lambda x: F.unfold(x[0], (2, 3), padding=(0, 1)),
}


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unfold_matches_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)


def _traffic_and_layout(mesh_shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple:
    mesh = get_mesh(mesh_shape)
    x = distribute_tensor(randn((1, 4, 16, 8)), mesh, [Shard(d) for d in dims]).requires_grad_(True)
    with count_communication() as forward:
        y = F.unfold(x, 3, padding=1)
    with count_communication() as backward:
        y.backward(torch.ones_like(y))
    return y.placements, [(r.kind, r.bytes_sent) for r in forward.records], backward.bytes_sent


def test_only_halo_rows_travel_and_rows_stay_a_contiguous_shard() -> None:
    """2 ranks over H: one (1, 4, 1, 8) float32 row to the neighbour (128 bytes) each way."""
    for placements, forward, backward_bytes in run_on_ranks(2, _traffic_and_layout, (2,), (2,)):
        assert placements == (Shard(2),)
        assert sum(nbytes for _, nbytes in forward) == 128, forward
        assert backward_bytes == 128


def test_a_2d_decomposition_gives_each_rank_its_block_of_positions() -> None:
    """2 x 2 over H and W: the output positions are each rank's (8, 4) block, flattened (StridedShard);
    a rank sends a row, a column and a corner (4 * (8 + 4 + 1) float32 = 208 bytes)."""
    for placements, forward, backward_bytes in run_on_ranks(4, _traffic_and_layout, (2, 2), (2, 3)):
        assert placements == (StridedShard(2, (16, 8), 0), StridedShard(2, (16, 8), 1))
        assert sum(nbytes for _, nbytes in forward) == 208, forward
        assert backward_bytes == 208


FOLD_FAMILY: dict[str, Callable] = {
    "fold(unfold(3, padding=1))": lambda x: F.fold(F.unfold(x, 3, padding=1), x.shape[-2:], 3, padding=1),
    "fold of a dilated, strided unfold": lambda x: F.fold(
        F.unfold(x, (3, 2), dilation=(1, 2), padding=(1, 0), stride=(2, 1)) * 2,
        x.shape[-2:], (3, 2), dilation=(1, 2), padding=(1, 0), stride=(2, 1),
    ),
    "nn.Fold of patches (stride = kernel) to a smaller grid": lambda x: nn.Fold((6, 4), 2, stride=2)(
        F.unfold(x, 2, stride=2)[..., :6].exp()
    ),
    "fold of an unbatched unfold": lambda x: F.fold(F.unfold(x[0], (2, 3), padding=(0, 1)), x.shape[-2:], (2, 3), padding=(0, 1)),
}


def _check_fold(layout: str) -> list[str]:
    return check_family(layout, FOLD_FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fold_matches_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check_fold, layout)[0]
    assert len(checked) == 3 * len(FOLD_FAMILY)


def _fold_traffic(mesh_shape: tuple[int, ...], dims: tuple[int, ...], sizes: dict, kernel: int, padding: int, stride: int) -> tuple:
    mesh = get_mesh(mesh_shape)
    x = distribute_tensor(randn((1, 4, 16, 8)), mesh, [Shard(d) for d in dims], sizes)
    cols = F.unfold(x, kernel, padding=padding, stride=stride).requires_grad_(True)
    with count_communication() as forward:
        y = F.fold(cols, (16, 8), kernel, padding=padding, stride=stride)
    with count_communication() as backward:
        y.backward(torch.ones_like(y))
    return y._spec == x._spec, forward.bytes_sent, backward.bytes_sent


@pytest.mark.parametrize(
    "mesh_shape, dims, sizes, expected",
    [
        ((2,), (2,), {0: [7, 9]}, 128),  # a (1, 4, 1, 8) row
        ((2,), (3,), None, 4 * 16 * 4),  # a (1, 4, 16, 1) column: unfold's strided positions, not gathered
        ((2, 2), (2, 3), None, 4 * (8 + 4 + 1) * 4),  # a row, a column and a corner
    ],
    ids=["H, uneven", "W", "2x2"],
)
def test_fold_returns_the_unfold_split_and_sends_only_overlapping_rows(mesh_shape, dims, sizes, expected) -> None:
    """An overlapping fold (3 x 3, padding 1) sends each neighbour the rows its windows reach into,
    and its backward the same; non-overlapping patches (2 x 2, stride 2) send nothing."""
    world = 4 if len(mesh_shape) == 2 else 2
    for same_spec, forward, backward in run_on_ranks(world, _fold_traffic, mesh_shape, dims, sizes, 3, 1, 1):
        assert same_spec and (forward, backward) == (expected, expected)
    even = None if sizes is None else {0: [8, 8]}
    for same_spec, forward, backward in run_on_ranks(world, _fold_traffic, mesh_shape, dims, even, 2, 0, 2):
        assert same_spec and (forward, backward) == (0, 0)


# ----- the halo path: stride 1 and 'same' padding along the one split dim ----------------------------
HALO_FAMILY: dict[str, Callable] = {
    "unfold(3, padding=1), strided along the whole dim": lambda x: F.unfold(x, 3, padding=1, stride=(1, 2)),
    "unfold((5, 5), dilation 2, padding 4) * 2": lambda x: F.unfold(x, 5, dilation=2, padding=4) * 2,
    "unfold((1, 3), padding=(0, 1)): no halo along H": lambda x: F.unfold(x, (1, 3), padding=(0, 1)),
    "fold(unfold((5, 5), padding 2) squared)": lambda x: F.fold(F.unfold(x, 5, padding=2).square(), x.shape[-2:], 5, padding=2),
    "its gradient, differentiated again": lambda x: torch.autograd.grad(
        F.fold(F.unfold(x, 3, padding=1).square(), x.shape[-2:], 3, padding=1).square().sum(), x, create_graph=True
    )[0],
}
HALO_CASES = {  # (world, split dim, global (N, C, H, W), sizes of the split dim or None for balanced)
    "2 ranks on H, uneven": (2, 2, (2, 3, 17, 9), [9, 8]),
    "3 ranks on H": (3, 2, (1, 2, 24, 7), None),
    "2 ranks on W": (2, 3, (1, 3, 7, 18), None),
    "3 ranks on W, uneven": (3, 3, (2, 2, 6, 26), [8, 8, 10]),
    "4 ranks on H, uneven": (4, 2, (1, 2, 35, 6), [8, 9, 8, 10]),
}


def _check_halo_family(dim: int, shape: tuple[int, ...], sizes: list[int] | None) -> list[str]:
    mesh = get_mesh((dist.get_world_size(),))
    x = randn(shape)
    for fn in HALO_FAMILY.values():
        assert_sharded_matches(fn, [x], mesh, [[Shard(dim)]], sharding_sizes=[None if sizes is None else {0: sizes}])
    return list(HALO_FAMILY)


@pytest.mark.parametrize("case", sorted(HALO_CASES))
def test_halo_path_matches_single_device(case: str) -> None:
    """Every shard holds the 2 p rows the path needs (p = 4 for the dilated 5 x 5), so each case takes it."""
    world, dim, shape, sizes = HALO_CASES[case]
    extent = shape[dim]
    split = sizes or [extent // world + (r < extent % world) for r in range(world)]
    assert min(split) >= 8 and halo_unfold_geometry(dim - 2, split, 0, (5, 5), (2, 2), (4, 4), (1, 1)) is not None
    assert run_on_ranks(world, _check_halo_family, dim, shape, sizes)[0] == list(HALO_FAMILY)


def _ops_touching_slab_sized_tensors() -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            out = func(*args, **(kwargs or {}))
            big = isinstance(out, torch.Tensor) and out.device.type != "meta" and out.numel() >= 4 * 16 * 8  # a slab or more
            if big and not func.is_view:  # (meta tensors: the argument checks at the global shape)
                self.names.append(func.__name__)
            return out

    x = distribute_tensor(randn((1, 4, 32, 8)), get_mesh((2,)), [Shard(2)]).requires_grad_(True)
    recorder = Recorder()
    with recorder:
        y = F.fold(F.unfold(x, 3, padding=1), (32, 8), 3, padding=1)
        y.backward(torch.ones_like(y))
    return recorder.names


def test_a_same_stencil_copies_no_slab() -> None:
    """unfold and fold of a 3 x 3 'same' stencil make no slab-sized tensor but torch's own: im2col and
    col2im each way, and what autograd allocates (the output's cotangent, the input's gradient)."""
    for names in run_on_ranks(2, _ops_touching_slab_sized_tensors):
        assert sorted(names) == ["col2im.default", "col2im.default", "im2col.default", "im2col.default", "ones_like.default"], names


def _same_stencil_output_nodes(world: int) -> list[str]:
    x = distribute_tensor(randn((2, 3, 12, 4)), get_mesh((world,)), [Shard(2)]).requires_grad_(True)
    h = x * 1.5  # an activation, as in a network
    cols = F.unfold(h, 3, padding=1)
    folded = F.fold(cols * 1.0, (12, 4), 3, padding=1)
    return [type(cols.grad_fn).__name__, type(cols.grad_fn.next_functions[0][0]).__name__, type(folded.grad_fn).__name__]


def test_a_same_stencil_unfold_and_fold_are_one_autograd_node_each() -> None:
    """The halo Functions return their output ShardTensor themselves: no conversion node after them,
    which cost tens of microseconds per op forward and again backward; unfold's takes its input
    whole too (the activation's node is next)."""
    for nodes in run_on_ranks(3, _same_stencil_output_nodes, 3):
        assert nodes == ["_HaloUnfoldBackward", "MulBackward0", "_HaloFoldBackward"], nodes


def test_halo_path_takes_only_same_stride_one_stencils_on_wide_enough_shards() -> None:
    take = halo_unfold_geometry(0, [4, 4], 1, (3, 3), (1, 1), (1, 1), (1, 1))
    assert take is not None and (take.has_prev, take.has_next, take.halo) == (True, False, 1)
    assert halo_unfold_geometry(0, [4, 4], 0, (3, 3), (1, 1), (1, 1), (2, 1)) is None  # stride 2 along the split
    assert halo_unfold_geometry(0, [4, 4], 0, (3, 3), (1, 1), (0, 1), (1, 1)) is None  # not 'same'
    assert halo_unfold_geometry(0, [4, 1], 0, (3, 3), (1, 1), (1, 1), (1, 1)) is None  # a shard thinner than 2 p
    assert halo_unfold_geometry(1, [4, 4], 0, (3, 3), (1, 1), (1, 0), (2, 1)) is None  # W split, not 'same' along W
    assert halo_unfold_geometry(0, [1, 1], 0, (1, 3), (1, 1), (0, 1), (1, 5)) is not None  # no halo along H


# ----- Tensor.unfold: sliding windows along one dim ------------------------------------------------
WINDOWS_FAMILY: dict[str, Callable] = {
    "x.unfold(2, 2, 2), patches": lambda x: x.unfold(2, 2, 2),
    "x.unfold(2, 3, 1), overlapping": lambda x: x.unfold(2, 3, 1) * 2,
    "x.unfold(-2, 3, 2)": lambda x: x.unfold(-2, 3, 2),
    "x.unfold(2, H, 1), one window": lambda x: x.unfold(2, x.shape[2], 1),
    "x.unfold(3, 2, 1), along W": lambda x: x.unfold(3, 2, 1),
    "x.unfold(1, 2, 1), along C": lambda x: x.unfold(1, 2, 1).sum(-1),
    "patchify: x.unfold(2, 2, 2).unfold(3, 2, 2)": lambda x: x.unfold(2, 2, 2).unfold(3, 2, 2),
}


def _check_windows(layout: str) -> list[str]:
    return check_family(layout, WINDOWS_FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sliding_windows_match_single_device(layout: str) -> None:
    """``Tensor.unfold`` raised on every layout before: DTensor has no rule for ``aten.unfold``."""
    checked = run_on_ranks(world_of(layout), _check_windows, layout)[0]
    assert len(checked) == 3 * len(WINDOWS_FAMILY)


def _window_traffic() -> dict[str, tuple]:
    mesh = get_mesh((2,))
    found = {}
    for name, (size, step) in {"patches": (2, 2), "overlapping": (3, 1)}.items():
        x = distribute_tensor(randn((1, 2, 8, 4)), mesh, [Shard(2)]).requires_grad_(True)
        with count_communication() as forward:
            y = x.unfold(2, size, step)
        with count_communication() as backward:
            y.backward(torch.ones_like(y))
        found[name] = (forward.bytes_sent, backward.bytes_sent, y._spec.axis_sizes[0], x.grad._spec == x._spec)
    return found


def test_sliding_windows_send_only_halo_rows() -> None:
    """Patches cut at the split's boundaries send nothing.  Windows of 3 rows at step 1 go to the
    rank holding their centre row, so each rank sends the other one row (2 channels x 4 values of
    4 bytes) and gets its gradient back; x's gradient keeps x's split."""
    for found in run_on_ranks(2, _window_traffic):
        assert found["patches"] == (0, 0, (2, 2), True), found
        assert found["overlapping"] == (2 * 4 * 4, 2 * 4 * 4, (3, 3), True), found
