"""F.interpolate / nn.Upsample on spatially sharded grids: exact values, gradients and halo bytes.

First the per-dim formulas alone, against ``F.interpolate`` on plain tensors (nearest modes
bit-exact, including both of torch's CPU kernels; linear and cubic to rounding).  Then every
mode sharded vs one device (``assert_sharded_matches``: outputs and input grads) on 1-4 ranks
and a 2x2 mesh, with balanced, uneven (13 x 7) and skewed splits (one-row and empty shards).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from physics_dp.ops._local import ShardedOpError
from physics_dp.ops.interpolation import dim_taps, resample, uses_vectorized_nearest
from physics_dp.shard_tensor import Partial, Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.testing import assert_sharded_matches, forward_backward_traffic, get_mesh, run_on_ranks

from .test_halo import LAYOUTS, SPLITS, window_gather_forbidden, world_of
from .test_pooling import batch_and_length, check_cases, half_or_global, hw, spatial

_DIMS = {"linear": 1, "bilinear": 2, "bicubic": 2, "trilinear": 3}


# ----- the formulas on plain tensors --------------------------------------------------------------
def _separable(x, out_shape, mode, align_corners, scales):
    """``F.interpolate`` rebuilt from :func:`dim_taps` and :func:`resample`, whole dims, one after the other."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    vectorized = uses_vectorized_nearest(x, out_shape)
    for dim, scale in zip(range(2, x.ndim), scales):
        taps = dim_taps(x.shape[dim], out_shape[dim], mode, bool(align_corners), scale, dtype, vectorized)
        x = resample(x, dim, taps, 0, out_shape[dim], 0)
    return x


def _random_call(rng, mode):
    """(input, kwargs) of a random F.interpolate call in ``mode`` that torch accepts."""
    nd = _DIMS.get(mode, rng.randint(1, 3))
    big = nd == 2 and rng.random() < 0.25  # 2-D nearest switches kernels above H + W = 128
    extent, out = (90, 100) if big else (17, 40) if nd < 3 else (9, 20)
    shape = [2, 3] + [rng.randint(1, extent) for _ in range(nd)]
    kwargs = {"mode": mode, "align_corners": None if mode.startswith("nearest") else rng.random() < 0.5}
    if rng.random() < 0.4:
        kwargs["size"] = [rng.randint(1, out) for _ in range(nd)]
    else:
        choices = [0.3, 0.5, 1 / 3, 0.7, 1.0, 1.003, 1.05, 1.5, 2.0, 2.003, 2.5, 3.0]
        kwargs["scale_factor"] = [rng.choice(choices + [rng.uniform(0.2, 4.0)]) for _ in range(nd)]
        kwargs["recompute_scale_factor"] = rng.choice([None, False, True])
        if any(int(n * s) < 1 for n, s in zip(shape[2:], kwargs["scale_factor"])):
            kwargs["scale_factor"] = [max(s, 1.0) for s in kwargs["scale_factor"]]
    return shape, kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear"])
def test_separable_formulas_match_torch(mode, dtype):
    rng = random.Random(f"{mode}{dtype}")
    tolerance = 0.0 if mode.startswith("nearest") else (1e-5 if dtype == torch.float32 else 1e-12)
    for trial in range(150):
        shape, kwargs = _random_call(rng, mode)
        x = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(trial))
        expected = F.interpolate(x, **kwargs)
        given = kwargs.get("scale_factor") if not kwargs.get("recompute_scale_factor") else None
        scales = given if given is not None else [None] * (x.ndim - 2)
        actual = _separable(x, expected.shape, mode, kwargs["align_corners"], scales)
        worst = (actual - expected).abs().max().item()
        assert worst <= tolerance * max(1.0, expected.abs().max().item()), (shape, kwargs, worst)


def test_nearest_follows_the_kernel_torch_picks():
    # 11 -> 11 rows with scale_factor 1.05: the vectorized 2-D kernel copies, the generic one does not
    x = torch.arange(11.0).view(1, 1, 11, 1)
    small = F.interpolate(x, scale_factor=(1.05, 1.0))
    assert uses_vectorized_nearest(x, small.shape) and torch.equal(small.flatten(), torch.arange(11.0))
    ramp = torch.arange(11.0).view(1, 1, 11)
    generic = F.interpolate(ramp, scale_factor=1.05)
    assert not uses_vectorized_nearest(ramp, generic.shape)
    assert torch.equal(_separable(ramp, generic.shape, "nearest", None, [1.05]), generic)


# ----- sharded vs one device ----------------------------------------------------------------------
def _up(**kwargs):
    return lambda h, w: nn.Upsample(**kwargs)


def _interp(**kwargs):
    return lambda h, w: (lambda x: F.interpolate(x, **kwargs))


# name -> (module or fn from (H, W), input shape from (H, W), placements from mesh)
CASES = {
    "nearest_x2": (_up(scale_factor=2), lambda h, w: (2, 3, h, w), hw),
    "nearest_size_up": (lambda h, w: nn.Upsample(size=(2 * h + 3, w + 2)), lambda h, w: (2, 3, h, w), hw),
    "nearest_x0.5": (_up(scale_factor=0.5), lambda h, w: (2, 3, h, w), hw),
    "nearest_x1.7_recompute": (_interp(scale_factor=1.7, recompute_scale_factor=True), lambda h, w: (2, 3, h, w), hw),
    "nearest_x1.05_x2.003_kernel_shortcuts": (_up(scale_factor=(1.05, 2.003)), lambda h, w: (1, 2, h, w), hw),
    "nearest_exact_x2": (_up(scale_factor=2, mode="nearest-exact"), lambda h, w: (2, 3, h, w), hw),
    "nearest_exact_size_down": (
        lambda h, w: nn.Upsample(size=(h // 2 + 1, w - 2), mode="nearest-exact"),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "bilinear_x2": (_up(scale_factor=2, mode="bilinear"), lambda h, w: (2, 3, h, w), hw),
    "bilinear_align_size": (
        lambda h, w: nn.Upsample(size=(h + 5, 2 * w - 1), mode="bilinear", align_corners=True),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "bilinear_x0.6": (_up(scale_factor=0.6, mode="bilinear"), lambda h, w: (2, 3, h, w), hw),
    "bilinear_x1.3_align_recompute": (
        _interp(scale_factor=1.3, mode="bilinear", align_corners=True, recompute_scale_factor=True),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "bilinear_x3_x1.5": (_up(scale_factor=(3.0, 1.5), mode="bilinear"), lambda h, w: (1, 2, h, w), hw),
    "bilinear_w_over_axis0": (_up(scale_factor=(1.5, 2.5), mode="bilinear"), lambda h, w: (2, 3, w, h), spatial(3, 2)),
    "bicubic_x2": (_up(scale_factor=2, mode="bicubic"), lambda h, w: (2, 3, h, w), hw),
    # torch's own kernel on the window (integer power-of-two factors, here given as sizes)
    "bilinear_size_x2_x4": (lambda h, w: nn.Upsample(size=(2 * h, 4 * w), mode="bilinear"), lambda h, w: (2, 3, h, w), hw),
    "bicubic_align_size": (
        lambda h, w: nn.Upsample(size=(2 * h - 3, w + 4), mode="bicubic", align_corners=True),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "bicubic_x0.5": (_up(scale_factor=0.5, mode="bicubic"), lambda h, w: (2, 3, h, w), hw),
    "bicubic_x2.5_x0.7": (_up(scale_factor=(2.5, 0.7), mode="bicubic"), lambda h, w: (1, 2, h, w), hw),
    "linear_x2.5": (_up(scale_factor=2.5, mode="linear"), lambda h, w: (2, 3, h), batch_and_length),
    "linear_x2": (_up(scale_factor=2, mode="linear"), lambda h, w: (2, 3, h), batch_and_length),
    "trilinear_x2_x1_x4": (_up(scale_factor=(2.0, 1.0, 4.0), mode="trilinear"), lambda h, w: (1, 2, h, w, 3), hw),
    "linear_align_size": (
        lambda h, w: nn.Upsample(size=2 * h - 1, mode="linear", align_corners=True),
        lambda h, w: (2, 3, h),
        batch_and_length,
    ),
    "nearest1d_size": (lambda h, w: nn.Upsample(size=h + 3), lambda h, w: (2, 3, h), batch_and_length),
    "trilinear_x1.5_x2_x1": (_up(scale_factor=(1.5, 2.0, 1.0), mode="trilinear"), lambda h, w: (1, 2, h, w, 3), hw),
    "trilinear_align_size_down": (
        lambda h, w: nn.Upsample(size=(h // 2 + 1, w + 1, 5), mode="trilinear", align_corners=True),
        lambda h, w: (1, 2, h, w, 4),
        hw,
    ),
    "nearest3d_x2_x0.5_x1.5": (_up(scale_factor=(2.0, 0.5, 1.5)), lambda h, w: (1, 2, h, w, 4), hw),
    "area_halves": (
        lambda h, w: (lambda x: F.interpolate(x, size=(half_or_global(h), half_or_global(w)), mode="area")),
        lambda h, w: (2, 3, h, w),
        hw,
    ),
    "bilinear_batch_only": (
        _up(scale_factor=2, mode="bilinear"),
        lambda h, w: (h, 3, 6, 5),
        lambda mesh: [Shard(0)] if mesh.ndim == 1 else [Shard(0), Replicate()],
    ),
    "antialias_channel_sharded": (
        _interp(scale_factor=0.5, mode="bilinear", antialias=True),
        lambda h, w: (w, h, 8, 6),
        spatial(1, 0),
    ),
}


def _interpolation_cases(mesh_shape, split, names):
    return check_cases(CASES, mesh_shape, split, names)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_interpolation_matches_single_device(mesh_shape, split):
    names = sorted(CASES)
    world = world_of(mesh_shape)
    assert run_on_ranks(world, _interpolation_cases, mesh_shape, split, names, timeout=120) == [len(names)] * world


# ----- communication ------------------------------------------------------------------------------
def _upsample_bytes(mesh_shape, upsample):
    """(coordinate, forward records, backward records) of ``upsample`` on (2, 3, 12, 8) sharded on H (and W)."""
    mesh = get_mesh(mesh_shape)
    x = distribute_tensor(torch.randn(2, 3, 12, 8), mesh, hw(mesh)).requires_grad_(True)
    return (tuple(mesh.get_coordinate()), *forward_backward_traffic(upsample, x))


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (4,), (2, 2)], ids=str)
def test_nearest_upsampling_by_two_sends_nothing(mesh_shape):
    for coordinate, forward, backward in run_on_ranks(world_of(mesh_shape), _upsample_bytes, mesh_shape, nn.Upsample(scale_factor=2)):
        assert forward == [] and backward == [], (coordinate, forward, backward)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bilinear_upsampling_exchanges_one_row_with_each_neighbour(world):
    # 12 rows, scale 2, align_corners=False: a rank owns outputs 2 lo .. 2 hi - 1; the first reads
    # the previous rank's last row, the last the next rank's first.  The backward returns the
    # gradient of each such row to its owner.  Nothing else travels.
    row = 2 * 3 * 8 * 4
    upsample = nn.Upsample(scale_factor=2, mode="bilinear")
    for (c,), forward, backward in run_on_ranks(world, _upsample_bytes, (world,), upsample):
        neighbours = (c > 0) + (c < world - 1)
        assert sorted(forward) == [("p2p", row)] * neighbours, (c, forward)
        assert sorted(backward) == [("p2p", row)] * neighbours, (c, backward)


def _upsampled_splits(world):
    """The input and output splits of a bilinear x2 upsample."""
    mesh = get_mesh((world,))
    x = distribute_tensor(torch.randn(2, 3, 4 * world + 1, 8), mesh, hw(mesh)).requires_grad_(True)
    y = F.interpolate(x, scale_factor=2, mode="bilinear")
    return x._spec.axis_sizes[0], y._spec.axis_sizes[0]


@pytest.mark.parametrize("world", [2, 3])
def test_power_of_two_upsampling_keeps_the_split_in_proportion(world):
    # so a U-Net's skip connection (the encoder's split, before a pooling by two) meets the
    # upsampled decoder features without a redistribution
    for sizes, out_sizes in run_on_ranks(world, _upsampled_splits, world):
        assert out_sizes == tuple(2 * s for s in sizes)


# ----- unsupported combinations -------------------------------------------------------------------
def _unsupported_raise():
    mesh = get_mesh((2,))
    x = torch.randn(2, 3, 13, 8)
    sharded = distribute_tensor(x, mesh, [Shard(2)])
    messages = []
    with pytest.raises(ShardedOpError) as info:
        nn.Upsample(scale_factor=2)(ShardTensor.from_local(x, mesh, [Partial("sum")]))
    messages.append(str(info.value))
    with pytest.raises(ValueError, match="align_corners option can only be set"):
        F.interpolate(sharded, scale_factor=2, mode="nearest", align_corners=True)  # torch's own check
    return messages


def test_unsupported_combinations_raise_naming_op_placements_and_reason():
    (partial,) = run_on_ranks(2, _unsupported_raise)[0]
    assert partial.startswith("interpolate") and "Partial" in partial and "redistribute" in partial


def _resize_on_the_slab(world, name):
    """Power-of-two resizes of a 1-D split, with the window gather (a copy of the slab) forbidden."""
    import physics_dp.ops.interpolation as interpolation

    # the op, the global shape, and the smallest shard whose border windows reach only the neighbours
    fn, shape, small = {
        "bilinear_x2": (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), (2, 3, 5 * world + 2, 6), 2),
        "bicubic_x4_x2": (lambda t: F.interpolate(t, scale_factor=(4, 2), mode="bicubic"), (1, 2, 6 * world + 1, 5), 4),
        "trilinear_x2": (lambda t: F.interpolate(t, scale_factor=2, mode="trilinear"), (1, 2, 4 * world + 3, 3, 4), 2),
        "nearest_exact_x2": (lambda t: F.interpolate(t, scale_factor=2, mode="nearest-exact"), (2, 2, 3 * world, 5), 1),
    }[name]
    mesh = get_mesh((world,))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    sizes = [{0: [small] * (world - 1) + [shape[2] - small * (world - 1)]}]  # uneven, small shards
    with window_gather_forbidden(interpolation, "gather_inside"):
        assert_sharded_matches(fn, [x], mesh, [[Shard(2)]], sharding_sizes=sizes)
        assert_sharded_matches(fn, [x], mesh, [[Shard(2)]])
    return True


@pytest.mark.parametrize("name", ["bilinear_x2", "bicubic_x4_x2", "trilinear_x2", "nearest_exact_x2"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_power_of_two_resizes_run_on_the_slab_without_copying_it(world, name):
    assert all(run_on_ranks(world, _resize_on_the_slab, world, name))


def _planned_in_inference_mode_then_differentiated(mode: str) -> tuple[float, float]:
    """The cached taps and plans of a size seen first under ``torch.inference_mode()``, then with autograd."""
    mesh = get_mesh((torch.distributed.get_world_size(),), ("domain",))
    x = torch.randn(1, 3, 23, 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # sizes no other test uses
    call = {"size": (37, 9), "mode": mode, **({} if mode == "nearest" else {"align_corners": False})}
    with torch.inference_mode():
        F.interpolate(distribute_tensor(x, mesh, [Shard(2)]), **call)
    sharded = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    y = F.interpolate(sharded, **call)
    y.backward(torch.ones_like(y))
    plain = x.clone().requires_grad_()
    expected = F.interpolate(plain, **call)
    expected.backward(torch.ones_like(expected))
    return (y.full_tensor() - expected).abs().max().item(), (sharded.grad.full_tensor() - plain.grad).abs().max().item()


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
@pytest.mark.parametrize("world", [2, 3])
def test_plans_made_in_inference_mode_serve_autograd_afterwards(world, mode):
    for output_error, grad_error in run_on_ranks(world, _planned_in_inference_mode_then_differentiated, mode):
        assert output_error < 1e-12 and grad_error < 1e-12
