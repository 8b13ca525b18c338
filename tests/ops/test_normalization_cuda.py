"""The sharded normalizations' local kernels on CUDA (skipped without a GPU; CI has none).

One GPU cannot host a 2-rank NCCL job, so the autograd functions behind sharded group, batch,
instance and layer norm run here over no process group: their statistics are the slab's own,
and forward and backward must equal torch's op on the same tensor.  This is where the CUDA
kernels' argument rules show (batch-norm backward reads the weight's device, for one).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from physics_dp.ops import normalization as N

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ours(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n, c = x.shape[:2]
    if kind == "layer":
        return N._NormalizeGlobally.apply(x, tuple(range(1, x.ndim)), (), 1e-5)
    layout = {"group": N._StatLayout(4, True), "batch": N._StatLayout(c, False), "instance": N._StatLayout(c, True)}[kind]
    return N._ChannelNorm.apply(x.reshape(n, c, -1), weight, bias, layout, (), 1e-5)[0].view(x.shape)


def _torch(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if kind == "group":
        return F.group_norm(x, 4, weight, bias)
    if kind == "batch":
        return F.batch_norm(x, None, None, weight, bias, training=True)
    if kind == "instance":
        return F.instance_norm(x, weight=weight, bias=bias)
    return F.layer_norm(x, x.shape[1:])


@pytest.mark.parametrize("kind", ["group", "batch", "instance", "layer"])
@pytest.mark.parametrize("shape", [(2, 8, 5, 7), (1, 16, 64, 48)])
def test_local_normalization_equals_torch_on_cuda(kind: str, shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (3 + torch.randn(shape, generator=generator)).cuda().requires_grad_()
    weight = torch.randn(shape[1], generator=generator).cuda().requires_grad_()
    bias = torch.randn(shape[1], generator=generator).cuda().requires_grad_()
    cotangent = torch.randn(shape, generator=generator).cuda()
    inputs = [x] if kind == "layer" else [x, weight, bias]
    results = []
    for op in (_ours, _torch):
        out = op(kind, x, weight, bias)
        results.append((out, *torch.autograd.grad(out, inputs, cotangent)))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
