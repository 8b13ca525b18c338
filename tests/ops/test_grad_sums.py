"""Parameter-gradient sums over the domain: one all-reduce per bucket per backward, equal to one device.

A small conv net (convs with bias, a transposed conv, a shared weight used twice) on 2 and 3
ranks with an uneven split: the parameter sums of a whole backward are one collective (one
bucket), gradients accumulate over two backward passes as on one device, ``torch.autograd.grad``
gets the summed gradient at once, and under ``immediate_parameter_sums`` (the FSDP/DDP adapter)
every use is summed at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops import grad_sums
from physics_dp.ops.grad_sums import immediate_parameter_sums
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.shared = nn.Parameter(torch.randn(4, 4, 1, 1) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(torch.tanh(self.conv1(x)), self.shared)
        return F.conv2d(self.up(self.down(y)), self.shared)


def _reference(model: nn.Module, x: torch.Tensor, passes: int) -> dict[str, torch.Tensor]:
    model.zero_grad()
    for _ in range(passes):
        model(x).square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _bucketed(world: int) -> dict[str, int]:
    mesh = get_mesh((world,))
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(2, 3, 14, 10)
    sizes = {2: [6, 8], 3: [6, 4, 4]}[world]
    xs = distribute_tensor(x, mesh, [Shard(2)], {0: sizes})
    counts = {}
    for passes in (1, 2):  # one backward, then gradient accumulation over two
        expected = _reference(model, x, passes)
        for _ in range(passes):
            loss = model(xs).square().mean()
            with count_communication() as log:
                loss.backward()
        counts[f"all_reduce per backward ({passes} passes)"] = log.kinds().count("all_reduce")
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)
        model.zero_grad()
    assert not grad_sums._stashes  # flushed at the end of every backward

    # torch.autograd.grad captures the gradient: it is summed at once, not deferred
    expected = _reference(model, x, 1)
    captured = torch.autograd.grad(model(xs).square().mean(), list(model.parameters()))
    for (name, _), grad in zip(model.named_parameters(), captured):
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)
    assert all(p.grad is None for p in model.parameters())

    # the FSDP/DDP adapter's mode: every parameter use summed at once
    with immediate_parameter_sums():
        loss = model(xs).square().mean()
    with count_communication() as log:
        loss.backward()
    counts["all_reduce immediate"] = log.kinds().count("all_reduce")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)
    return counts


@pytest.mark.parametrize("world", [2, 3])
def test_parameter_sums_are_one_bucket_per_backward_and_equal_one_device(world: int) -> None:
    for counts in run_on_ranks(world, _bucketed, world):
        # the loss mean's backward needs no collective; the 8 parameter uses share one bucket
        assert counts["all_reduce per backward (1 passes)"] == 1, counts
        assert counts["all_reduce per backward (2 passes)"] == 1, counts
        # conv1 (w, b), down (w, b), up (w; its bias is added after the local op), shared twice
        assert counts["all_reduce immediate"] >= 7, counts
