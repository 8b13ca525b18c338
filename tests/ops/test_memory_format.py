"""Channels-last tensors stay channels last through the sharded stencil ops and norms, as torch's own do.

Each op runs on a channels-last input (and a channels-last module where it has a weight) on 1-4
ranks and a 2 x 2 mesh, even, uneven and skewed splits (an empty shard among them): outputs, input
and parameter gradients equal one device's, and the output's layout is the one torch gives.
Channels last makes no more slab-sized copies than row-major: none in a block (group norm, SiLU,
3x3 conv), pooling or interpolation, forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops import fused_cpu
from physics_dp.shard_tensor import Shard, ShardTensor, distribute_tensor
from physics_dp.shard_tensor.spec import laid_out_as
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_normalization import SHAPES, on_stock_kernels, randn, sharding, world_of
from .test_shape_ops import run_combos

CL = torch.channels_last


def _module(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return factory().to(memory_format=CL)

    return build


# name -> a fresh module (its weight channels last) or a function of one (N, 4, H, W) input
CASES: dict[str, Callable[[], Callable]] = {
    "conv 3x3": _module(lambda: nn.Conv2d(4, 5, 3, padding=1)),
    "conv 3x3, row-major weight": lambda: (torch.manual_seed(0), nn.Conv2d(4, 5, 3, padding=1))[1],
    "conv 3x3 stride 2": _module(lambda: nn.Conv2d(4, 5, 3, stride=2, padding=1)),
    "conv 1x1": _module(lambda: nn.Conv2d(4, 5, 1)),
    "conv 2x2 valid": _module(lambda: nn.Conv2d(4, 5, 2)),
    "conv transpose 4x4 stride 2": _module(lambda: nn.ConvTranspose2d(4, 3, 4, stride=2, padding=1)),
    "group norm": _module(lambda: nn.GroupNorm(2, 4)),
    "instance norm (affine)": _module(lambda: nn.InstanceNorm2d(4, affine=True)),
    "batch norm": _module(lambda: nn.BatchNorm2d(4)),
    "layer norm over (C, H, W)": lambda: (lambda t: F.layer_norm(t, t.shape[1:])),
    "avg pool 2": lambda: (lambda t: F.avg_pool2d(t, 2)),
    "max pool 3, stride 1": lambda: (lambda t: F.max_pool2d(t, 3, 1, 1)),
    "reflect pad": lambda: (lambda t: F.pad(t, (1, 1, 1, 1), mode="reflect")),
    "circular pad": lambda: (lambda t: F.pad(t, (1, 1, 1, 1), mode="circular")),
    "conv 3x3, reflect padding": _module(lambda: nn.Conv2d(4, 5, 3, padding=1, padding_mode="reflect")),
    "nearest x2": lambda: (lambda t: F.interpolate(t, scale_factor=2, mode="nearest")),
    "bilinear x2": lambda: (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear")),
    "norm, silu, conv": _module(lambda: nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 4, 3, padding=1))),
}


def _layout_of(t: torch.Tensor) -> str:
    return "channels last" if t.is_contiguous(memory_format=CL) and not t.is_contiguous() else "row-major"


def _check(name: str, x: torch.Tensor, mesh, placements, sizes) -> Callable[[], None]:
    def check() -> None:
        fn = CASES[name]()
        assert_sharded_matches(fn, [x], mesh, [placements], sharding_sizes=[sizes], atol=1e-4, rtol=1e-4)
        expected = _layout_of(CASES[name]()(x))
        sharded = fn(distribute_tensor(x, mesh, placements, sizes))
        assert _layout_of(sharded) == expected, f"{name}: {_layout_of(sharded)}, torch gives {expected}"
        assert laid_out_as(sharded.to_local(), sharded._spec), f"{name}: the slab is not laid out as its spec"

    return check


def _all_cases(layout: str, names: Sequence[str] = tuple(CASES)) -> list[str]:
    combos = {}
    for split, shape in SHAPES.items():
        mesh, placements, sizes = sharding(layout, split, shape)
        x = randn(shape).contiguous(memory_format=CL)
        for name in names:
            combos[f"{name} on {layout} ({split})"] = _check(name, x, mesh, placements, sizes)
    return run_combos(combos)


@pytest.mark.parametrize("layout", ["1", "2", "3", "4", "2x2-HxW"])
def test_channels_last_stays_channels_last_and_matches_one_device(layout):
    assert all(run_on_ranks(world_of(layout), _all_cases, layout))


_NORM_CASES = ("group norm", "instance norm (affine)", "batch norm", "norm, silu, conv")


@pytest.mark.parametrize("layout", ["2", "3", "4", "2x2-HxW"])
def test_channels_last_norms_on_stock_kernels_match_one_device(layout):
    """The norms' path on a GPU, a CPU rank without a compiler or in a torch.compile trace: the stock
    kernels' channels-last paths read the slab in place (see the copy count below)."""
    assert all(run_on_ranks(world_of(layout), on_stock_kernels, _all_cases, layout, _NORM_CASES))


def _weight_only(world: int) -> bool:
    """A row-major input into a channels-last convolution comes out channels last, as with torch."""
    mesh = get_mesh((world,))
    x = randn((2, 4, 9, 6))
    conv = CASES["conv 3x3"]()
    assert_sharded_matches(conv, [x], mesh, [[Shard(2)]], atol=1e-4, rtol=1e-4)
    assert _layout_of(conv(distribute_tensor(x, mesh, [Shard(2)]))) == _layout_of(conv(x)) == "channels last"
    return True


def test_a_channels_last_weight_makes_a_channels_last_output():
    assert all(run_on_ranks(2, _weight_only, 2))


def _three_d(world: int) -> bool:
    mesh = get_mesh((world,))
    x = randn((2, 4, 3, 7, 5)).contiguous(memory_format=torch.channels_last_3d)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4)).to(memory_format=torch.channels_last_3d)
    assert_sharded_matches(block, [x], mesh, [[Shard(3)]], atol=1e-4, rtol=1e-4)
    out = block(distribute_tensor(x, mesh, [Shard(3)]))
    assert out.is_contiguous(memory_format=torch.channels_last_3d) and not out.is_contiguous()
    return True


@pytest.mark.parametrize("kernels", ["fused CPU", "stock"])
def test_channels_last_3d_convolution_and_norm(kernels):
    if kernels == "stock":
        assert all(run_on_ranks(3, on_stock_kernels, _three_d, 3))
    else:
        assert all(run_on_ranks(2, _three_d, 2))


class _SlabCopies(TorchDispatchMode):
    """Copies of at least ``numel`` values (clone, copy_, _to_copy, contiguous) made under the mode."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.copies = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
            source = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
            if not isinstance(source, ShardTensor) and source.numel() >= self.numel:
                self.copies.append(str(func))
        return out


def _copies(memory_format: torch.memory_format) -> tuple[dict[str, list[str]], dict[str, tuple[int, int]]]:
    """Slab-sized copies made by each op's forward and backward (after a warm call) on 2 ranks, and
    the (bytes, collectives) this rank sent for them."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    ops = {
        "norm, silu, conv": nn.Sequential(nn.GroupNorm(4, 16), nn.SiLU(), nn.Conv2d(16, 16, 3, padding=1)).to(memory_format=memory_format),
        "avg pool 2": lambda t: F.avg_pool2d(t, 2),
        "max pool 3, stride 1": lambda t: F.max_pool2d(t, 3, 1, 1),
        "nearest x2": lambda t: F.interpolate(t, scale_factor=2, mode="nearest"),
        "bilinear x2": lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"),
    }
    copies, sent = {}, {}
    for name, op in ops.items():
        x = distribute_tensor(randn((1, 16, 32, 24)).contiguous(memory_format=memory_format), mesh, [Shard(2)])
        x.requires_grad_(True)
        grad = torch.ones_like(op(x))  # (warm: plans and kernels built before counting)
        with _SlabCopies(x.to_local().numel()) as mode, count_communication() as log:
            op(x).backward(grad)
        copies[name], sent[name] = mode.copies, (log.bytes_sent, log.calls)
    return copies, sent


def test_channels_last_makes_no_more_slab_copies_than_row_major():
    """A channels-last block (group norm, SiLU, 3x3 conv) copies no slab, nor do pooling and
    interpolation; max pooling's backward copies its own rows once in either layout.  Both layouts
    send the same bytes in the same collectives (halo rows and statistics: no gather of a slab)."""
    if not fused_cpu.build():
        pytest.skip("the fused CPU kernels could not be built here")
    channels_last = run_on_ranks(2, _copies, CL)
    row_major = run_on_ranks(2, _copies, torch.contiguous_format)
    assert channels_last == row_major, (channels_last, row_major)
    slab_bytes = 16 * 16 * 24 * 4  # a rank's (1, 16, 16, 24) slab
    for copies, sent in channels_last:
        assert all(sent_bytes < slab_bytes for sent_bytes, _ in sent.values()), sent
        assert all(not made for name, made in copies.items() if name != "max pool 3, stride 1"), copies
        assert len(copies["max pool 3, stride 1"]) <= 1, copies


def test_channels_last_norms_on_stock_kernels_copy_no_slab():
    """On the stock kernels (a GPU, a CPU rank without a compiler), a channels-last group norm reads
    and writes its slab in place as the fused kernels do: it used to copy the slab row-major for its
    statistics, its output back to channels last, and its gradient both ways (6x the fused path's
    time for (1, 64, 256, 256) on 2 ranks)."""
    for copies, _ in run_on_ranks(2, on_stock_kernels, _copies, CL):
        assert not copies["norm, silu, conv"], copies
