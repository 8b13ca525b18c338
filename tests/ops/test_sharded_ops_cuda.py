"""The op library's sharded code on CUDA tensors (skipped without a GPU; CI has none).

One GPU hosts only a 1-rank mesh, whose size-1 axis would run every op as the plain op on its
slab.  With that shortcut switched off (``sharded_code_on_size_one_axes``), each handler runs its
sharded code (halo strips, statistics merge, FFT pencils, attention ring, reductions; collectives
over one rank return their input), so CUDA's rules (index tensors on the device, kernel
arguments) are exercised against the plain op: output, input gradient and parameter gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

from physics_dp.distributed import DistributedManager
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import sharded_code_on_size_one_axes

from ._op_cases import OPS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


@pytest.mark.parametrize(
    "make", [lambda: nn.GroupNorm(2, 8), lambda: nn.BatchNorm2d(8), lambda: nn.InstanceNorm2d(8, affine=True), lambda: nn.LayerNorm([8, 16, 12])],
    ids=["group", "batch", "instance", "layer"],
)
def test_norms_under_autocast_give_torchs_dtype(make, one_gpu_mesh, without_size_one_shortcut) -> None:
    """A bf16 activation under autocast: torch's CUDA policy runs group and layer norm in fp32 (and
    returns fp32); the sharded handler, which sees the input above autocast, must do the same."""
    torch.manual_seed(0)
    norm = make().cuda()
    x = torch.randn(2, 8, 16, 12, device="cuda").to(torch.bfloat16)
    sharded_x = distribute_tensor(x, one_gpu_mesh, [Shard(2)])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = norm(x)
        out = norm(sharded_x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out.full_tensor(), expected, atol=2e-2, rtol=2e-2)
