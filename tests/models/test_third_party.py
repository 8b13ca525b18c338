"""Unmodified models from third-party libraries, domain-parallel on 3 and 2 x 2 ranks == one device.

Each model is built the library's usual way, seeded, synced over the mesh and fed a field that
rank 0 scatters and that is then split unevenly along its height, as a physics_dp user would run
it. The output, the input gradient and every parameter gradient must equal one device's.
Together they cover spectral (FFT) layers (neuraloperator's FNO), attention and strided
down/upsampling (diffusers' UNet2DModel), transposed convolutions and max pooling (MONAI's
BasicUNet). The libraries are test extras: without them these tests skip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import pytest
import torch
import torch.distributed as dist

from physics_dp import Shard, scatter_tensor
from physics_dp.nn import sync_module_over_mesh
from physics_dp.testing import assert_sharded_matches, get_mesh, run_on_ranks

H, W = 2, 3  # tensor dims of (N, C, H, W) fields


def _fno(factorization: str | None) -> torch.nn.Module:
    from neuralop.models import FNO

    return FNO(n_modes=(6, 5), in_channels=2, out_channels=2, hidden_channels=8, n_layers=2, factorization=factorization, rank=0.5)


def _diffusers_unet() -> torch.nn.Module:
    from diffusers import UNet2DModel

    return UNet2DModel(
        sample_size=16,
        in_channels=2,
        out_channels=2,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        attention_head_dim=4,
        norm_num_groups=4,
    )


_TIMESTEPS = (torch.tensor([3.0, 250.0]),)


def _monai_basic_unet() -> torch.nn.Module:
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=2, in_channels=2, out_channels=2, features=(4, 4, 8, 8, 16, 4), upsample="deconv")


def _monai_basic_unet_3d() -> torch.nn.Module:
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=1, features=(2, 2, 4, 4, 8, 2), upsample="deconv")


def _in_float64(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    return build().double()


def _sharded_matches(
    build: Callable[[], torch.nn.Module],
    shape: Sequence[int],
    splits: dict[int, Sequence[int]],
    extra: tuple,
    dtype: torch.dtype,
    atol: float,
) -> dict[str, float]:
    """On every rank: the user's recipe (seeded model synced over the mesh, input scattered from
    rank 0 and re-split as ``splits`` says: tensor dim -> sizes along one mesh axis), compared
    with one device; returns the largest differences.  ``dtype`` is the input's; the output must
    keep the input's placements."""
    mesh = get_mesh(tuple(len(sizes) for sizes in splits.values()))
    placements = [Shard(dim) for dim in splits]
    torch.manual_seed(0)
    model = sync_module_over_mesh(build(), mesh)
    field = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    x = scatter_tensor(field if dist.get_rank() == 0 else None, 0, mesh, placements)
    x = x.redistribute(placements=placements, sharding_sizes=dict(enumerate(splits.values())))
    coordinate = mesh.get_coordinate()
    assert [x.to_local().shape[dim] for dim in splits] == [sizes[c] for sizes, c in zip(splits.values(), coordinate)]
    report = assert_sharded_matches(model, [x, *extra], mesh, [None] * (1 + len(extra)), atol=atol, rtol=atol)
    assert report.output_placements == [tuple(placements)], report.output_placements
    # Every parameter's gradient was compared, and none is identically zero (a real comparison).
    compared = {name.removesuffix(".grad") for name in report.max_abs_diff if name.endswith(".grad")}
    missing = {name for name, _ in model.named_parameters()} - compared
    assert not missing, f"parameters without a compared gradient: {sorted(missing)}"
    zero = [name for name, p in model.named_parameters() if not p.grad.any()]
    assert not zero, f"parameters whose gradient is zero: {zero}"
    return report.max_abs_diff


def _check(
    build: Callable[[], torch.nn.Module],
    shape: Sequence[int],
    splits: dict[int, Sequence[int]],
    extra: tuple = (),
    dtype: torch.dtype = torch.float32,
    atol: float = 1e-4,
) -> None:
    for dim, sizes in splits.items():
        assert sum(sizes) == shape[dim] and len(set(sizes)) == len(sizes)  # uneven
    ranks = math.prod(len(sizes) for sizes in splits.values())
    reports = run_on_ranks(ranks, _sharded_matches, build, shape, splits, extra, dtype, atol, timeout=300.0)
    assert all(max(r.values()) <= atol for r in reports)


@pytest.mark.parametrize("factorization", [None, "tucker"], ids=["dense", "tucker"])
def test_neuraloperator_fno(factorization):
    """FNO: lifting/projection channel MLPs, a grid positional embedding, SpectralConv (rfft2 ->
    complex mode weights, dense or a tensorly-torch Tucker factorization, contracted by tensorly's
    einsum -> irfft2) and linear skips."""
    pytest.importorskip("neuralop")
    _check(partial(_fno, factorization), (2, 2, 16, 12), {H: [7, 5, 4]})


def test_diffusers_unet2d():
    """UNet2DModel: timestep embedding, ResNet blocks with GroupNorm, strided-conv downsampling,
    self-attention over all H*W tokens, nearest upsampling."""
    pytest.importorskip("diffusers")
    _check(_diffusers_unet, (2, 2, 16, 12), {H: [7, 5, 4]}, _TIMESTEPS)


def test_monai_basic_unet():
    """BasicUNet: conv + InstanceNorm + LeakyReLU blocks, 2x2 max pooling four times,
    transposed-conv upsampling and skip concatenations. One sample: its first weight gradients are
    O(100) (InstanceNorm), so a batch of two sums float32 rounding to ~2e-4 absolute (relative
    2e-6; in float64 the same model agrees to 1e-11)."""
    pytest.importorskip("monai")
    _check(_monai_basic_unet, (1, 2, 48, 16), {H: [19, 16, 13]})


def test_monai_basic_unet_float64_odd_sizes():
    """Two samples and a height and width that 16 does not divide: BasicUNet's skip connections
    then pad the upsampled map by replication, along the sharded height too. In float64 the sharded
    run agrees to rounding, which shows the float32 differences above are rounding as well."""
    pytest.importorskip("monai")
    _check(partial(_in_float64, _monai_basic_unet), (2, 2, 44, 20), {H: [17, 15, 12]}, dtype=torch.float64, atol=1e-9)


def test_monai_basic_unet_3d_float64():
    """The 3-D BasicUNet (conv3d, max_pool3d, conv_transpose3d) on a volume split along its depth.
    In float32 its weight gradients carry rounding of ~2e-4 like the 2-D one; float64 shows the
    sharded run exact."""
    pytest.importorskip("monai")
    depth = 2  # dim 2 of (N, C, D, H, W)
    _check(partial(_in_float64, _monai_basic_unet_3d), (1, 1, 32, 16, 16), {depth: [13, 11, 8]}, dtype=torch.float64, atol=1e-9)


@pytest.mark.parametrize(
    "library, build, shape, extra",
    [
        ("neuralop", partial(_fno, None), (2, 2, 16, 12), ()),
        ("diffusers", _diffusers_unet, (2, 2, 16, 12), _TIMESTEPS),
        ("monai", _monai_basic_unet, (1, 2, 48, 16), ()),
    ],
    ids=["fno", "diffusers_unet2d", "monai_basic_unet"],
)
def test_on_height_by_width_mesh(library, build, shape, extra):
    """The same models with the height split over one mesh axis and the width over the other (2 x 2
    ranks, both uneven); the output keeps both splits (the FNO's channel MLPs and diffusers'
    attention flatten H*W into strided tokens and back)."""
    pytest.importorskip(library)
    height, width = shape[H], shape[W]
    _check(build, shape, {H: [height // 2 + 1, height // 2 - 1], W: [width // 2 + 1, width // 2 - 1]}, extra)
