"""F.interpolate(..., antialias=True) on spatially sharded grids: exact values, gradients and halo bytes.

Downsampling by ``s`` widens torch's antialias filter ``s`` times, so an output's taps span
more rows than without antialias.  First the per-dim taps alone against ``F.interpolate`` on
plain tensors, then sharded vs one device (outputs and input grads) on 1-4 ranks and a 2x2
mesh, balanced, uneven and skewed (one-row and empty shards), then the rows that travel.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from physics_dp.ops._local import ShardedOpError
from physics_dp.ops.interpolation import dim_taps, resample
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import assert_sharded_matches, forward_backward_traffic, get_mesh, run_on_ranks

from .test_halo import LAYOUTS, SPLITS, world_of
from .test_pooling import check_cases, hw

_MODES = ("bilinear", "bicubic", "lanczos")


# ----- the taps on plain tensors ------------------------------------------------------------------
def _random_call(rng: random.Random, mode: str) -> tuple[list[int], dict]:
    """(input shape, kwargs) of a random antialiased resize of H, W or both, down or up."""
    shape = [1, 2, rng.randint(1, 40), rng.randint(1, 40)]
    kwargs = {"mode": mode, "antialias": True, "align_corners": mode != "lanczos" and rng.random() < 0.4}
    if rng.random() < 0.5:
        kwargs["size"] = [rng.randint(2, 60), rng.randint(2, 60)]  # output width 1: see test_torch_cpu_output_width_one
    else:
        factors = [rng.choice([0.5, 0.25, 1 / 3, 1.0, 1.5, 2.0, rng.uniform(0.05, 4.0)]) for _ in range(2)]
        kwargs["scale_factor"] = [max(f, 2.5 / n) for f, n in zip(factors, shape[2:])]
        kwargs["recompute_scale_factor"] = rng.choice([None, False, True])
    return shape, kwargs


def _separable_antialias(x: torch.Tensor, out_shape: torch.Size, kwargs: dict) -> torch.Tensor:
    """``F.interpolate`` rebuilt from :func:`dim_taps`: W first, then H, as torch's kernel."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    given = kwargs.get("scale_factor") if not kwargs.get("recompute_scale_factor") else None
    scales = given if given is not None else [None, None]
    for dim in (3, 2):
        taps = dim_taps(x.shape[dim], out_shape[dim], kwargs["mode"], kwargs["align_corners"], scales[dim - 2], dtype, False, True)
        x = resample(x, dim, taps, 0, out_shape[dim], 0)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mode", _MODES)
def test_antialias_taps_match_torch(mode, dtype):
    rng = random.Random(f"{mode}{dtype}")
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    for trial in range(300):
        shape, kwargs = _random_call(rng, mode)
        x = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(trial))
        expected = F.interpolate(x, **kwargs)
        worst = (_separable_antialias(x, expected.shape, kwargs) - expected).abs().max().item()
        assert worst <= tolerance * max(1.0, expected.abs().max().item()), (shape, kwargs, worst)


def test_downsampling_widens_the_taps_with_the_factor():
    # bilinear x1/4: output 3 is centred at 14 with a triangle 4 rows wide on each side (without
    # antialias: 2 rows); output 0's window is clamped to the grid, its weights renormalized
    taps = dim_taps(32, 8, "bilinear", False, 0.25, torch.float32, False, True)
    assert taps.rows[3].tolist() == list(range(10, 18))
    assert taps.weights[3].tolist() == [w / 32 for w in (1, 3, 5, 7, 7, 5, 3, 1)]
    assert taps.rows[0].unique().tolist() == list(range(6)) and torch.allclose(taps.weights.sum(1), torch.ones(8))


def test_torch_cpu_output_width_one():
    # torch's CPU kernel gives every row of a vertical pass whose output is 1 wide the first row's
    # taps (unlike its filter for any wider output), so a sharded resize that would differ raises
    # (test_resizing_the_height_to_a_width_of_one_raises); when torch fixes this, drop that error
    x = torch.arange(16.0).view(1, 1, 8, 2)
    wide = F.interpolate(x, size=(4, 2), mode="bilinear", antialias=True)
    narrow = F.interpolate(x[..., :1], size=(4, 1), mode="bilinear", antialias=True)
    assert torch.allclose(_separable_antialias(x, wide.shape, {"mode": "bilinear", "align_corners": False}), wide)
    assert not torch.equal(narrow, wide[..., :1]) and narrow.unique().numel() == 1


# ----- sharded vs one device ----------------------------------------------------------------------
def _interp(**kwargs):
    return lambda h, w: (lambda x: F.interpolate(x, antialias=True, **kwargs))


def _nchw(h, w):
    return (2, 3, h, w)


# name -> (fn from (H, W), input shape from (H, W), placements from mesh)
CASES = {
    "bilinear_x0.5": (_interp(scale_factor=0.5, mode="bilinear"), _nchw, hw),
    "bilinear_x0.3_recompute": (_interp(scale_factor=0.3, mode="bilinear", recompute_scale_factor=True), _nchw, hw),
    "bilinear_size_down_align": (
        lambda h, w: (lambda x: F.interpolate(x, size=(h // 3 + 1, w - 3), mode="bilinear", align_corners=True, antialias=True)),
        _nchw,
        hw,
    ),
    "bilinear_size_up_align": (
        lambda h, w: (lambda x: F.interpolate(x, size=(2 * h + 1, w + 3), mode="bilinear", align_corners=True, antialias=True)),
        _nchw,
        hw,
    ),
    "bilinear_h_only_x0.4": (_interp(scale_factor=(0.4, 1.0), mode="bilinear"), _nchw, hw),
    "bicubic_x0.45_align": (_interp(scale_factor=0.45, mode="bicubic", align_corners=True), _nchw, hw),
    "bicubic_size_down": (
        lambda h, w: (lambda x: F.interpolate(x, size=(h // 2 - 1, w // 2 + 1), mode="bicubic", antialias=True)),
        _nchw,
        hw,
    ),
    "bicubic_x1.7_x0.6": (_interp(scale_factor=(1.7, 0.6), mode="bicubic"), _nchw, hw),
    "bicubic_x2": (_interp(scale_factor=2, mode="bicubic"), _nchw, hw),
    "lanczos_x0.4_x1.5": (_interp(scale_factor=(0.4, 1.5), mode="lanczos"), _nchw, hw),
}


def _antialias_cases(mesh_shape) -> int:
    names = sorted(CASES)
    return sum(check_cases(CASES, mesh_shape, split, names) for split in SPLITS)


@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_antialias_matches_single_device(mesh_shape):
    # every split (balanced, 13 x 7 uneven, skewed with one-row and empty shards) in one launch
    world = world_of(mesh_shape)
    assert run_on_ranks(world, _antialias_cases, mesh_shape, timeout=120) == [len(CASES) * len(SPLITS)] * world


def _empty_middle_shard() -> int:
    mesh = get_mesh((3,))
    x = torch.randn(2, 3, 7, 9, generator=torch.Generator().manual_seed(3))
    calls = [
        {"scale_factor": 0.5, "mode": "bilinear"},
        {"size": (3, 4), "mode": "bicubic", "align_corners": True},
        {"size": (11, 5), "mode": "bicubic"},
        {"scale_factor": 1.5, "mode": "bilinear"},
    ]
    for call in calls:
        assert_sharded_matches(lambda t: F.interpolate(t, antialias=True, **call), [x], mesh, [[Shard(2)]], sharding_sizes=[{0: [3, 0, 4]}])
    return len(calls)


def test_antialias_with_an_empty_shard_in_the_middle():
    assert run_on_ranks(3, _empty_middle_shard) == [4] * 3


# ----- communication ------------------------------------------------------------------------------
def _downsample_bytes(world: int) -> dict[str, tuple[list, list]]:
    """This rank's (forward, backward) records of antialiased halvings of (2, 3, 24, 8) sharded on H."""
    mesh = get_mesh((world,))
    records = {}
    for mode in ("bilinear", "bicubic"):
        x = distribute_tensor(torch.randn(2, 3, 24, 8), mesh, [Shard(2)]).requires_grad_(True)
        records[mode] = forward_backward_traffic(lambda t: F.interpolate(t, scale_factor=0.5, mode=mode, antialias=True), x)
    return records


@pytest.mark.parametrize("world", [2, 3, 4])
def test_antialiased_halving_exchanges_only_the_rows_its_taps_read(world):
    # x1/2: output i is centred on row 2i + 1 (owned with it) and reads rows 2i - 1 .. 2i + 2 with
    # the triangle, 2i - 3 .. 2i + 4 with the cubic (both twice as wide as without antialias); a
    # rank holding the even-aligned rows [lo, hi) reads rows lo - 1 .. hi (bilinear), lo - 3 ..
    # hi + 2 (bicubic): 1 and 3 rows from each neighbour, and their gradients go back.  Nothing
    # else travels, however many rows the rank holds.
    row = 2 * 3 * 8 * 4
    for rank, records in enumerate(run_on_ranks(world, _downsample_bytes, world)):
        neighbours = (rank > 0) + (rank < world - 1)
        for mode, rows in (("bilinear", 1), ("bicubic", 3)):
            forward, backward = records[mode]
            assert sorted(forward) == [("p2p", rows * row)] * neighbours, (rank, mode, forward)
            assert sorted(backward) == [("p2p", rows * row)] * neighbours, (rank, mode, backward)


# ----- what still raises --------------------------------------------------------------------------
def _kept_dim_raises_only_for_autograd() -> tuple[float, str]:
    mesh = get_mesh((2,))
    x = distribute_tensor(torch.randn(2, 3, 12, 8), mesh, [Shard(2)])
    call = {"scale_factor": (0.5, 1.05), "mode": "bilinear", "antialias": True}
    error = (F.interpolate(x, **call).full_tensor() - F.interpolate(x.full_tensor(), **call)).abs().max().item()
    with pytest.raises(ShardedOpError) as info:
        F.interpolate(x.requires_grad_(), **call)
    return error, str(info.value)


def test_a_kept_dim_with_a_factor_raises_when_differentiated():
    # 8 x 1.05 rounds down to 8: torch's forward copies W, yet its backward resamples W with the
    # factor (when torch fixes that, drop the error); the sharded forward alone is exact
    plain = torch.randn(1, 1, 4, 8, requires_grad=True)
    copied = F.interpolate(plain, scale_factor=(1.0, 1.05), mode="bilinear", antialias=True)
    copied.backward(torch.ones_like(copied))
    assert torch.equal(copied, plain) and not torch.allclose(plain.grad, torch.ones_like(plain))
    for error, message in run_on_ranks(2, _kept_dim_raises_only_for_autograd):
        assert error < 1e-6
        assert message.startswith("interpolate") and "Shard(dim=2)" in message and "keeps dims [3]" in message
        assert "recompute_scale_factor=True" in message


def _width_one_raises() -> str:
    plain = torch.randn(2, 3, 12, 8, generator=torch.Generator().manual_seed(0))
    x = distribute_tensor(plain, get_mesh((2,)), [Shard(2)])
    kept = {"size": (12, 1), "mode": "bilinear", "antialias": True}  # the height kept: exact
    torch.testing.assert_close(F.interpolate(x, **kept).full_tensor(), F.interpolate(plain, **kept))
    with pytest.raises(ShardedOpError) as info:
        F.interpolate(x, size=(3, 1), mode="bilinear", antialias=True)
    return str(info.value)


def test_resizing_the_height_to_a_width_of_one_raises():
    for message in run_on_ranks(2, _width_one_raises):
        assert "width of 1" in message and "resize the height first" in message
