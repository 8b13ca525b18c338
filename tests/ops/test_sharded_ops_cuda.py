"""The op library's sharded code on CUDA tensors (skipped without a GPU; CI has none).

One GPU hosts only a 1-rank mesh, whose size-1 axis would run every op as the plain op on its
slab.  With that shortcut switched off (``sharded_code_on_size_one_axes``), each handler runs its
sharded code (halo strips, statistics merge, FFT pencils, attention ring, reductions; collectives
over one rank return their input), so CUDA's rules (index tensors on the device, kernel arguments) are exercised against the plain op: output,
input gradient and parameter gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from physics_dp.distributed import DistributedManager
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import sharded_code_on_size_one_axes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _attention(t: torch.Tensor) -> torch.Tensor:
    tokens = t.flatten(2).transpose(1, 2).unsqueeze(1)  # (N, 1, H*W, C): H-sharded tokens
    return F.scaled_dot_product_attention(tokens, tokens, tokens)


OPS: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "conv2d": lambda: nn.Conv2d(8, 8, 3, padding=1),
    "conv2d stride 2": lambda: nn.Conv2d(8, 8, 3, stride=2, padding=1),
    "conv_transpose2d": lambda: nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1),
    "group_norm": lambda: nn.GroupNorm(2, 8),
    "batch_norm": lambda: nn.BatchNorm2d(8),
    "layer_norm": lambda: nn.LayerNorm([8, 16, 12]),
    "avg_pool2d": lambda: lambda t: F.avg_pool2d(t, 2),
    "max_pool2d": lambda: lambda t: F.max_pool2d(t, 3, 1, 1),
    "interpolate bilinear": lambda: lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"),
    "interpolate nearest": lambda: lambda t: F.interpolate(t, scale_factor=2),
    "pad circular": lambda: lambda t: F.pad(t, (2, 2, 2, 2), mode="circular"),
    "pad reflect": lambda: lambda t: F.pad(t, (1, 1, 1, 1), mode="reflect"),
    "fft2": lambda: lambda t: torch.fft.fft2(t).abs(),
    "rfft2": lambda: lambda t: torch.fft.rfft2(t).abs(),
    "attention": lambda: _attention,
    "var over H, W": lambda: lambda t: t.var((2, 3)),
    "amax over H": lambda: lambda t: t.amax(2),
    "softmax over H": lambda: lambda t: t.softmax(2),
    "pointwise chain": lambda: lambda t: F.silu(t * 2 + 1) * t,
    "index_select over H": lambda: lambda t: t.index_select(2, torch.tensor([0, 3, 7], device=t.device)),
}


@pytest.fixture
def without_size_one_shortcut() -> Iterator[None]:
    with sharded_code_on_size_one_axes():
        yield


@pytest.mark.parametrize("name", sorted(OPS))
def test_sharded_op_equals_plain_on_cuda(name: str, one_gpu_mesh, without_size_one_shortcut) -> None:
    torch.manual_seed(0)
    op = OPS[name]()
    device = DistributedManager().device
    if isinstance(op, nn.Module):
        op = op.to(device)
    params = list(op.parameters()) if isinstance(op, nn.Module) else []
    x = torch.randn(2, 8, 16, 12, device=device)
    plain_x = x.clone().requires_grad_()
    expected = op(plain_x)
    cotangent = torch.randn_like(expected)
    wanted = torch.autograd.grad(expected, [plain_x, *params], cotangent)
    sharded_x = distribute_tensor(x, one_gpu_mesh, [Shard(2)]).requires_grad_()
    out = op(sharded_x)
    got = torch.autograd.grad(out, [sharded_x, *params], distribute_tensor(cotangent, one_gpu_mesh, out.placements))
    torch.testing.assert_close(out.full_tensor(), expected, atol=1e-4, rtol=1e-5)
    for grad, want in zip(got, wanted):
        torch.testing.assert_close(grad.full_tensor() if hasattr(grad, "full_tensor") else grad, want, atol=1e-4, rtol=1e-5)


def test_index_select_over_a_sharded_dim_waits_for_the_gpu_once(one_gpu_mesh, without_size_one_shortcut) -> None:
    """Routing rows reads the index's values on the host: one copy there, not a wait per read
    (before: eight, from the range check, ``unique``, the owners and the counts; then three, with
    the plan copied back to the GPU by blocking copies)."""
    device = DistributedManager().device
    x = distribute_tensor(torch.randn(2, 8, 16, 12, device=device), one_gpu_mesh, [Shard(2)])
    index = torch.tensor([0, 3, 7, 3], device=device)
    x.index_select(2, index)  # the first call may build caches
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            x.index_select(2, index)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    waits = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(waits) == 1, waits
