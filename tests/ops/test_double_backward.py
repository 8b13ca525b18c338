"""Double backward (create_graph=True, then backward) on ShardTensors: equal to one device, or a
clear error where an op's explicit backward is not itself differentiable (never silently wrong).

Gradient penalties, as physics-informed losses and WGAN-GP build them, through every op family
with a halo or global statistics: the conv family (halo fast path, window-gather path,
transposed), pad, pooling, interpolation, unfold and fold, the four norms, attention with sharded keys (ring attention refuses);
input and parameter gradients, on 2 and 3 ranks with uneven splits, and a 2x2 mesh.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from physics_dp.shard_tensor import Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

from .test_normalization import on_stock_kernels
from .test_strided import LAYOUTS as STRIDED_LAYOUTS
from .test_strided import SHAPE as STRIDED_SHAPE
from .test_strided import _attention as strided_attention

WEIGHT = torch.linspace(-1, 1, 4 * 3 * 9).reshape(4, 3, 3, 3)

# Paths made of pointwise ops, reductions, views and conversions: differentiable twice.
TWICE_DIFFERENTIABLE = {
    "pointwise": lambda x: torch.tanh(x) * x,
    "reductions": lambda x: torch.sin(x) * x.mean(dim=2, keepdim=True) + x.sum() * 0.01,
    "views": lambda x: torch.tanh(x.flatten(2)).reshape(2, 3, 7, 6) * x,
    "roll": lambda x: torch.roll(torch.tanh(x), 2, dims=2) * x,
    "conversions": lambda x: ShardTensor.from_local(torch.tanh(x.to_local()), x.device_mesh, x.placements)
    * x.redistribute(placements=[Replicate()]),
    "conv": lambda x: torch.tanh(F.conv2d(x, WEIGHT, padding=1)),
    "conv_circular": lambda x: torch.tanh(F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), WEIGHT)),
    "group_norm": lambda x: F.group_norm(torch.tanh(x), 3),
    "avg_pool": lambda x: F.avg_pool2d(torch.tanh(x), 2),
    "max_pool": lambda x: F.max_pool2d(x * x, 2),
    "interpolate": lambda x: F.interpolate(torch.tanh(x), scale_factor=2, mode="bilinear"),
    "fft": lambda x: torch.fft.rfft2(torch.tanh(x)).abs(),
    "fft of a real input": lambda x: torch.fft.fft2(torch.tanh(x)).abs(),
    "softmax": lambda x: torch.softmax(x * x, dim=2),
    "unfold and fold": lambda x: F.fold(torch.tanh(F.unfold(x * x, 3, padding=1)), x.shape[-2:], 3, padding=1),
}
# Explicit backwards that communicate and are not written differentiably: refused.
ONCE_DIFFERENTIABLE = {
    "index_select": lambda x: torch.tanh(x).index_select(2, torch.tensor([0, 5, 3])),
    "gather": lambda x: torch.tanh(x).gather(2, torch.zeros(2, 3, 7, 6, dtype=torch.long)),
}


def _gradient_penalty_grad(fn, x):
    """d/dx of |d(sum fn(x)^2)/dx|^2: a gradient penalty, as physics-informed losses build."""
    (gx,) = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    return x.grad


def _double_backward_cases(world):
    mesh = get_mesh((world,))
    g = torch.randn(2, 3, 7, 6, generator=torch.Generator().manual_seed(0))
    for name, fn in TWICE_DIFFERENTIABLE.items():
        sharded = _gradient_penalty_grad(fn, distribute_tensor(g.clone(), mesh, [Shard(2)]).requires_grad_(True))
        reference = _gradient_penalty_grad(
            lambda t: fn_plain(name, t), g.clone().requires_grad_(True)
        )
        torch.testing.assert_close(sharded.full_tensor(), reference, rtol=1e-4, atol=1e-4, msg=name)
    for name, fn in ONCE_DIFFERENTIABLE.items():
        x = distribute_tensor(g.clone(), mesh, [Shard(2)]).requires_grad_(True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            _gradient_penalty_grad(fn, x)
    return True


def fn_plain(name, t):
    if name == "conversions":  # the same function without the conversions
        return torch.tanh(t) * t
    return TWICE_DIFFERENTIABLE[name](t)


@pytest.mark.parametrize("world", [2, 3])
def test_double_backward_equals_one_device_or_raises(world):
    run_on_ranks(world, _double_backward_cases, world)


# ----- modules with parameters: input and parameter gradients of a gradient penalty ------------
class LayerNormHW(nn.Module):
    """Layer norm over (H, W): statistics over the sharded grid."""

    def __init__(self, h: int, w: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm([h, w])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class Pad(nn.Module):
    def __init__(self, pads: tuple[int, ...], mode: str) -> None:
        super().__init__()
        self.pads, self.mode = pads, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, self.pads, mode=self.mode)


def _field(h: int, w: int):
    """name -> (module factory, input shape) on an (N, C, H, W) field (3-D conv: (N, C, H, W, 4))."""
    return {
        "conv2d_same_fast_path": (lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, h, w)),
        "conv2d_k5_same_fast_path": (lambda: nn.Conv2d(3, 2, 5, padding=2, bias=False), (1, 3, h, w)),
        "conv1d_same_fast_path": (lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, h)),
        "conv3d_same_fast_path": (lambda: nn.Conv3d(3, 2, 3, padding=1), (1, 3, h, w, 4)),
        # on 2 ranks ([8, 5] rows) the strided fast path, on 3 ([5, 3, 5]: odd shards) the window gather
        "conv2d_stride2": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, h, w)),
        "conv2d_k5_stride2_halo_both_sides": (lambda: nn.Conv2d(3, 2, 5, stride=2, padding=2), (1, 3, h, w)),
        "conv2d_circular_window": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"), (2, 3, h, w)),
        "conv_transpose2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1), (2, 3, h, w)),
        "conv_transpose2d_upsampling_fast_path": (lambda: nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1), (2, 3, h, w)),
        "conv1d_transposed_upsampling_fast_path": (
            lambda: nn.ConvTranspose1d(3, 2, 3, stride=2, padding=1, output_padding=1, bias=False), (2, 3, h),
        ),
        "pad_reflect_conv_valid": (lambda: nn.Sequential(Pad((1, 1, 2, 2), "reflect"), nn.Conv2d(3, 4, (5, 3))), (2, 3, h, w)),
        "avg_pool": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.AvgPool2d(3, stride=2, padding=1)), (2, 3, h, w)),
        "max_pool": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.MaxPool2d(2)), (2, 3, h, w)),
        "interpolate_bilinear": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.Upsample(scale_factor=2, mode="bilinear")), (2, 3, h, w)),
        "interpolate_nearest": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.Upsample(scale_factor=2)), (2, 3, h, w)),
        "group_norm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4)), (2, 3, h, w)),
        "batch_norm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), (2, 3, h, w)),
        "instance_norm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.InstanceNorm2d(4, affine=True)), (2, 3, h, w)),
        "layer_norm_hw": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), LayerNormHW(h, w)), (2, 3, h, w)),
    }


def _penalty(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty plus the output's mean: backward reaches x and every parameter twice over."""
    y = torch.tanh(module(x))
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    return gx.square().sum() + y.mean()


def _compare_penalty(name, factory, shape, mesh, placements, sizes, atol=1e-4, memory_format=torch.contiguous_format):
    torch.manual_seed(0)
    module = factory().to(memory_format=memory_format)
    reference = copy.deepcopy(module)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1)).contiguous(memory_format=memory_format)
    x = g.clone().requires_grad_(True)
    xs = distribute_tensor(g.clone(), mesh, placements, sizes).requires_grad_(True)
    _penalty(reference, x).backward()
    _penalty(module, xs).backward()
    torch.testing.assert_close(xs.grad.full_tensor(), x.grad, rtol=atol, atol=atol, msg=f"{name}: input grad")
    for (pname, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=atol, atol=atol, msg=f"{name}: {pname}.grad")


UNEVEN_H = {2: [8, 5], 3: [5, 3, 5]}
UNEVEN_TOKENS = {2: [6, 3], 3: [4, 1, 4]}


def _module_cases(world, names):
    mesh = get_mesh((world,))
    for name, (factory, shape) in _field(13, 6).items():
        if name in names:
            _compare_penalty(name, factory, shape, mesh, [Shard(2)], {0: UNEVEN_H[world]})
    return True


def _mesh_2x2_cases():
    """H x W over the two mesh axes; then batch x H (a data axis beside the domain axis) for the norms."""
    mesh = get_mesh((2, 2))
    for name, (factory, shape) in _field(13, 6).items():
        if name.startswith(("conv2d", "conv_transpose")) or name.endswith(("norm", "norm_hw")):
            _compare_penalty(name, factory, shape, mesh, [Shard(2), Shard(3)], {0: [8, 5], 1: [2, 4]})
    for name, (factory, shape) in _field(13, 6).items():
        if name.endswith(("norm", "norm_hw")):
            _compare_penalty(name, factory, (3, *shape[1:]), mesh, [Shard(0), Shard(2)], {0: [2, 1], 1: [8, 5]})
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("family", ["conv", "pad_pool_interpolate", "norm"])
def test_gradient_penalty_input_and_parameter_grads(world, family):
    names = {
        "conv": [n for n in _field(1, 1) if n.startswith("conv")],
        "pad_pool_interpolate": [n for n in _field(1, 1) if n.startswith(("pad", "avg", "max", "interpolate"))],
        "norm": [n for n in _field(1, 1) if n.endswith("norm") or n.endswith("norm_hw")],
    }[family]
    run_on_ranks(world, _module_cases, world, names)


def test_gradient_penalty_on_a_2x2_mesh():
    run_on_ranks(4, _mesh_2x2_cases)


def _channels_last_cases(world):
    """Channels-last inputs and modules: the norms' double backward reads their (N, L, C) work."""
    mesh = get_mesh((world,))
    for name in ("conv2d_same_fast_path", "group_norm", "batch_norm"):
        factory, shape = _field(13, 6)[name]
        _compare_penalty(name, factory, shape, mesh, [Shard(2)], {0: UNEVEN_H[world]}, memory_format=torch.channels_last)
    return True


@pytest.mark.parametrize("kernels", ["fused CPU", "stock"])
def test_gradient_penalty_of_channels_last_modules(kernels):
    if kernels == "stock":
        run_on_ranks(2, on_stock_kernels, _channels_last_cases, 2)
    else:
        run_on_ranks(2, _channels_last_cases, 2)


def _parameter_penalty(world):
    """A penalty on the weight's gradient (summed over ranks, then differentiated again)."""
    mesh = get_mesh((world,))
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    reference = copy.deepcopy(conv)
    g = torch.randn(2, 3, 13, 6, generator=torch.Generator().manual_seed(1))
    for module, x in ((reference, g), (conv, distribute_tensor(g, mesh, [Shard(2)], {0: UNEVEN_H[world]}))):
        loss = torch.tanh(module(x)).square().sum()
        (gw,) = torch.autograd.grad(loss, module.weight, create_graph=True)
        (gw.square().sum() + loss).backward()
    for p, q in zip(conv.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_parameter_gradient_penalty(world):
    run_on_ranks(world, _parameter_penalty, world)


def _autocast_fast_path_refuses(world):
    """The conv fast path saves bf16 casts under autocast: a double backward would miss the cast."""
    mesh = get_mesh((world,))
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = distribute_tensor(torch.randn(2, 3, 13, 6, generator=torch.Generator().manual_seed(1)), mesh, [Shard(2)], {0: UNEVEN_H[world]}).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x).float()
    (gx,) = torch.autograd.grad(y.square().sum(), x, retain_graph=True)  # a plain backward works
    with pytest.raises(RuntimeError, match="autocast"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    return gx.shape == x.shape


def _attention_penalty(world, q_placements, kv_placements, causal):
    """Input gradients of a gradient penalty through sdpa (one device: torch's math kernel)."""
    mesh = get_mesh((world,))
    q, kv = torch.randn(2, 1, 2, 9, 4, generator=torch.Generator().manual_seed(2))  # the same on every rank

    def shard(t, placements):
        split = {0: UNEVEN_TOKENS[world]} if placements[0].is_shard() else None
        return distribute_tensor(t, mesh, placements, split).requires_grad_(True)

    qs, kvs = shard(q, q_placements), shard(kv, kv_placements)
    q, kv = q.requires_grad_(True), kv.requires_grad_(True)
    for a, b in ((q, kv), (qs, kvs)):
        with sdpa_kernel(SDPBackend.MATH):  # torch's fused CPU kernel has no double backward
            y = F.scaled_dot_product_attention(a, b, b, is_causal=causal)
            ga, gb = torch.autograd.grad(y.square().sum(), (a, b), create_graph=True)
        (ga.square().sum() + gb.square().sum()).backward()
    torch.testing.assert_close(qs.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kvs.grad.full_tensor(), kv.grad, rtol=1e-4, atol=1e-4)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention(world, causal):
    """q and k/v tokens sharded: the ring's double backward gathers K/V differentiably."""
    run_on_ranks(world, _attention_penalty, world, [Shard(2)], [Shard(2)], causal)


class StridedTokenAttention(nn.Module):
    """Self-attention over the tokens of an H x W field flattened on a 2x2 mesh (a strided token dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.randn(12, 4) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return strided_attention(x, self.wq)


def _strided_ring():
    mesh_shape, placements, sizes = STRIDED_LAYOUTS["2x2"]
    with sdpa_kernel(SDPBackend.MATH):
        _compare_penalty("strided ring", StridedTokenAttention, STRIDED_SHAPE, get_mesh(mesh_shape), placements, sizes)
    return True


def test_ring_attention_over_strided_tokens():
    """Tokens of an H x W field flattened on a 2x2 mesh: the second backward views a cotangent
    whose slab is laid out unlike the global tensor (views.py copies there)."""
    run_on_ranks(4, _strided_ring)


@pytest.mark.parametrize("world", [2, 3])
def test_attention_with_sharded_keys(world):
    """Queries whole, keys and values sharded: per-rank blocks merged by differentiable sums."""
    run_on_ranks(world, _attention_penalty, world, [Replicate()], [Shard(2)], False)


@pytest.mark.parametrize("world", [2, 3])
def test_attention_with_whole_keys_under_the_math_kernel(world):
    """Queries sharded, keys whole: local attention, twice differentiable once the user picks torch's
    math kernel (as on one device: the fused CPU kernel has no double backward)."""
    run_on_ranks(world, _attention_penalty, world, [Shard(2)], [Replicate()], True)
