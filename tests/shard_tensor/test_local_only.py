"""Layouts that need no communication run the plain op: no collectives, results equal to torch.

A one-rank mesh (one domain rank) and a tensor replicated over every axis of more than one rank
both hold the global value in each slab.  A U-Net-like block (halo conv, group norm, SiLU,
pooling, upsampling, attention over tokens, reductions) must then issue zero collectives,
forward and backward, and equal the plain module in output, input and parameter gradients.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1, padding_mode="circular")
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(F.silu(self.norm(self.conv1(x))))
        y = F.interpolate(F.avg_pool2d(y, 2), scale_factor=2, mode="bilinear")
        tokens = y.flatten(2).transpose(1, 2)
        attended = self.attn(tokens, tokens, tokens, need_weights=False)[0]
        return y + attended.transpose(1, 2).reshape(y.shape) + y.mean((2, 3), keepdim=True)


def _no_communication(mesh_shape: tuple[int, ...], placements: list) -> dict[str, int]:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(2, 4, 10, 6)
    expected = model(x.clone().requires_grad_(True))
    reference_input = x.clone().requires_grad_(True)
    model(reference_input).square().sum().backward()
    reference_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    xs = distribute_tensor(x, mesh, placements).requires_grad_(True)
    with count_communication() as forward:
        ys = model(xs)
        loss = ys.square().sum()
    with count_communication() as backward:
        loss.backward()
    torch.testing.assert_close(ys.to_local(), expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xs.grad.to_local(), reference_input.grad, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    return {"forward": forward.calls, "backward": backward.calls}


def test_one_rank_mesh_runs_plain_ops_with_no_collectives() -> None:
    counts = run_on_ranks(1, _no_communication, (1,), [Shard(2)])[0]
    assert counts == {"forward": 0, "backward": 0}


def test_size_one_domain_axis_beside_a_replicated_axis_has_no_collectives() -> None:
    for counts in run_on_ranks(2, _no_communication, (2, 1), [Replicate(), Shard(2)]):
        assert counts == {"forward": 0, "backward": 0}


def _slice_is_a_tracked_view() -> bool:
    """On a one-rank mesh, x[...] is a view of x as in torch: an in-place update of the slice
    changes x, and autograd sees it (the gradient equals plain torch's)."""
    mesh = get_mesh((1,))
    base = torch.randn(2, 3, 6, 4)
    for source in (base, distribute_tensor(base, mesh, [Shard(2)])):
        leaf = source.clone().requires_grad_(True)
        x = leaf * 1.0
        x[:, :, 1:3].mul_(5.0)
        (x * x).sum().backward()
        if source is base:
            expected_value, expected_grad = x.detach(), leaf.grad
        else:
            torch.testing.assert_close(x.to_local().detach(), expected_value)
            torch.testing.assert_close(leaf.grad.to_local(), expected_grad)
    return True


def test_a_slice_on_a_one_rank_mesh_is_a_view_autograd_tracks() -> None:
    assert run_on_ranks(1, _slice_is_a_tracked_view) == [True]
