"""Libraries that pick a backend from the tensor's module treat ShardTensor as torch."""

from __future__ import annotations

import inspect

import pytest
import torch

from physics_dp.shard_tensor import Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

opt_einsum = pytest.importorskip("opt_einsum")


def test_the_class_reads_as_torch_and_stays_inspectable():
    assert type(torch.empty(0)).__module__.split(".")[0] == ShardTensor.__module__.split(".")[0] == "torch"
    assert "class ShardTensor" in inspect.getsource(ShardTensor)


def _contract_like_one_device(world):
    mesh = get_mesh((world,))
    a, b, w, cotangent = (torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in
                          enumerate([(7, 4, 5), (7, 5, 3), (3, 6), (7, 4, 6)]))
    x = distribute_tensor(a, mesh, [Shard(0)]).requires_grad_(True)
    y = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_(True)
    weight = w.clone().requires_grad_(True)
    out = opt_einsum.contract("bij,bjk,kl->bil", x, y, weight)  # a path of pairwise tensordots/einsums
    assert isinstance(out, ShardTensor) and out.placements == (Shard(0),)
    (out * distribute_tensor(cotangent, mesh, [Shard(0)])).sum().backward()

    ref = [t.clone().requires_grad_(True) for t in (a, b, w)]
    ref_out = torch.einsum("bij,bjk,kl->bil", *ref)
    (ref_out * cotangent).sum().backward()
    torch.testing.assert_close(out.full_tensor(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.full_tensor(), ref[0].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.grad.full_tensor(), ref[1].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, ref[2].grad, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_opt_einsum_contract_on_shard_tensors_matches_one_device(world):
    run_on_ranks(world, _contract_like_one_device, world)
