"""Ring attention's fused CUDA block kernels (skipped without a GPU; CI has none).

A ring merges per-block outputs with their log-sum-exps, then runs each block's backward from the
merged (global) output and log-sum-exp.  One GPU hosts one rank, whose ring has a single block,
so the multi-block contract is checked here directly on the block functions, keys split into
blocks on one device: outputs and gradients against float64 attention, no further off than
torch's own fused attention in the same dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from physics_dp.ops import attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _blockwise(q, k, v, blocks: list[int], grad_out):
    """Output and (dq, dk, dv) as the ring computes them, key/value blocks held side by side
    (k and v as slices of one concatenated block, as they travel)."""
    scale = q.shape[-1] ** -0.5
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    travelling = [torch.cat(pair, -1) for pair in zip(k.split(blocks, -2), v.split(blocks, -2))]
    e_k = k.shape[-1]
    for block in travelling:
        block_out, block_lse = attention._block_forward(q, block[..., :e_k], block[..., e_k:], None, scale)
        out, lse = attention._merge(out, lse, block_out, block_lse)
    out = out.to(q.dtype)
    safe_lse = attention._finite(lse)[..., None]
    delta = (grad_out * out).sum(-1, keepdim=True)
    grads = [attention._block_backward(grad_out, q, b[..., :e_k], b[..., e_k:], out, safe_lse, delta, None, scale) for b in travelling]
    grad_q = sum(g[0].float() for g in grads).to(q.dtype)
    return out, grad_q, torch.cat([g[1] for g in grads], -2), torch.cat([g[2] for g in grads], -2)


def _errors(got, want) -> list[float]:
    return [((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape, blocks", [((2, 4, 200, 64), [120, 80]), ((1, 2, 333, 32), [111, 111, 111]), ((1, 3, 97, 128), [50, 47])])
def test_block_kernels_merge_to_attention(dtype, shape, blocks, full_fp32) -> None:
    torch.manual_seed(0)
    q, k, v, grad_out = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
    expected_kind = "cuda" if dtype == torch.float32 else "cuda_flash"
    if attention._fused(q, k, v) != expected_kind:
        pytest.skip(f"this GPU or build admits no {expected_kind} kernel for {dtype}")
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*leaves)
    want = [reference.detach(), *torch.autograd.grad(reference, leaves, grad_out.double())]
    own = [t.clone().requires_grad_() for t in (q, k, v)]
    torch_out = F.scaled_dot_product_attention(*own)
    torch_errors = _errors([torch_out.detach(), *torch.autograd.grad(torch_out, own, grad_out)], want)
    errors = _errors(_blockwise(q, k, v, blocks, grad_out), want)
    floor = 1e-6 if dtype == torch.float32 else 2e-3
    for name, error, torch_error in zip(("out", "dq", "dk", "dv"), errors, torch_errors):
        assert error <= 2 * torch_error + floor, f"{name}: {error:.2e} against torch's own {torch_error:.2e}"
