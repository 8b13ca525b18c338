"""The sharded normalizations' local kernels on CUDA (skipped without a GPU; CI has none).

One GPU cannot host a 2-rank NCCL job, so the autograd functions behind sharded group, batch,
instance and layer norm run here over no process group: their statistics are the slab's own,
and forward and backward must equal torch's op on the same tensor.  This is where the CUDA
kernels' argument rules show (batch-norm backward reads the weight's device, for one).
"""

from __future__ import annotations

import pytest
import torch

from .test_normalization import local_norm, torch_norm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("kind", ["group", "batch", "instance", "layer"])
@pytest.mark.parametrize("shape", [(2, 8, 5, 7), (1, 16, 64, 48), (1, 4, 1024, 2048)])  # the last: rows of 2M+ values, cut into parts
def test_local_normalization_equals_torch_on_cuda(kind: str, shape: tuple[int, ...]) -> None:
    _check_against_torch(kind, shape, constant_rows=False)


@pytest.mark.parametrize("kind", ["group", "batch", "instance", "layer"])
def test_constant_rows_normalize_as_torch_on_cuda(kind: str) -> None:
    """CUDA's statistics kernel gives 1 / std = 0 (not inf) for a row of variance 0 with eps 0;
    read back as an infinite variance, it zeroed the row's output scale and input gradient."""
    _check_against_torch(kind, (2, 8, 5, 7), constant_rows=True)


@pytest.mark.parametrize("kind", ["group", "batch"])
@pytest.mark.parametrize("constant_rows", [False, True])
def test_channels_last_local_normalization_equals_torch_on_cuda(kind: str, constant_rows: bool) -> None:
    """A channels-last slab read in place by CUDA's batch-norm statistics and backward kernels."""
    _check_against_torch(kind, (2, 8, 37, 48), constant_rows, torch.channels_last)


def _check_against_torch(
    kind: str, shape: tuple[int, ...], constant_rows: bool, memory_format: torch.memory_format = torch.contiguous_format,
) -> None:
    generator = torch.Generator().manual_seed(0)
    x = 3 + torch.randn(shape, generator=generator)
    if constant_rows:  # a whole sample and a whole channel of zeros: constant rows for every kind
        x[0], x[:, 0] = 0.0, 0.0
    x = x.cuda().contiguous(memory_format=memory_format).requires_grad_()
    weight = torch.randn(shape[1], generator=generator).cuda().requires_grad_()
    bias = torch.randn(shape[1], generator=generator).cuda().requires_grad_()
    cotangent = torch.randn(shape, generator=generator).cuda()
    inputs = [x] if kind == "layer" else [x, weight, bias]
    exact = [t.detach().double().requires_grad_() for t in inputs]  # the float64 truth both are held to
    exact_out = torch_norm(kind, exact[0], *(exact[1:] if kind != "layer" else (None, None)))
    truth = (exact_out, *torch.autograd.grad(exact_out, exact, cotangent.double()))
    results = []
    for op in (local_norm, torch_norm):
        out = op(kind, x, weight, bias)
        results.append((out, *torch.autograd.grad(out, inputs, cotangent)))
    for got, reference, true in zip(*results, truth):
        # within 1e-5 of torch's float32 result, or no further from the float64 truth than torch is:
        # a parameter gradient sums a million float32 terms, and both sums carry rounding error
        ours_error, torch_error = (got.double() - true).abs().max(), (reference.double() - true).abs().max()
        if ours_error > 2 * torch_error:
            torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_long_rows_cut_into_parts_give_the_rows_moments_on_cuda(rows: int) -> None:
    from physics_dp.ops.moments import row_moments, row_parts

    length = 1 << 21
    assert row_parts(rows, length, torch.device("cuda")) > 1
    data = (100 + torch.randn(rows, length, generator=torch.Generator().manual_seed(rows), dtype=torch.float64)).cuda()
    data[0, :] = 0.0  # variance exactly 0, which the kernel reports as 1 / std = 0: read as inf
    _, mean, rstd = row_moments(data.float())
    want_var, want_mean = torch.var_mean(data, -1, correction=0)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(rstd[1:].double(), want_var[1:].rsqrt(), rtol=1e-4, atol=0)
    assert rstd[0] == float("inf")
