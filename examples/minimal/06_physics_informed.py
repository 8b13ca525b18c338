"""Tutorial 6: a physics-informed loss on a sharded 2-D field, trained domain-parallel.

Run:

    torchrun --standalone --nproc-per-node 3 examples/minimal/06_physics_informed.py

A small conv net predicts the heat equation's solution ``u(t) = net(u0, t)`` from an initial
field ``u0`` and a time ``t`` (a channel of the input, constant per sample).  Nothing supervises
it: the loss is the PDE residual ``du/dt - kappa * laplacian(u)``, where ``du/dt`` is an
autograd derivative of the net's output with respect to its time input, taken with
``create_graph=True`` so that training can backpropagate through it.  The Laplacian is a fixed
5-point stencil (a convolution, zero Dirichlet boundary).

``du/dt`` at every pixel is a Jacobian-vector product (the tangent is 1 for every time input).
Reverse-mode autograd gives it with the double-vjp trick: ``v = J^T w`` for a dummy ``w``
(``create_graph=True``), then ``J 1 = d(v . 1)/dw``.  So the loss differentiates the net twice
and training a third time, through halo convolutions, group norm and their gradients, all on
a field split unevenly along its height.  Every step's loss and the trained parameters equal
the same training on one device.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from physics_dp import DistributedManager, Shard
from physics_dp.shard_tensor import distribute_tensor

from _print import print0, print_in_rank_order

BATCH, HEIGHT, WIDTH, STEPS, KAPPA = 2, 23, 16, 4, 0.1  # 23 rows: uneven on 2, 3 and 4 ranks
LAPLACIAN = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]]).view(1, 1, 3, 3)


class HeatNet(nn.Module):
    """u(t) = u0 + t * correction(u0, t): the initial condition holds exactly at t = 0."""

    def __init__(self) -> None:
        super().__init__()
        self.correction = nn.Sequential(
            nn.Conv2d(2, 8, kernel_size=3, padding=1),
            nn.GroupNorm(2, 8),
            nn.Tanh(),
            nn.Conv2d(8, 8, kernel_size=3, padding=1, padding_mode="circular"),
            nn.Tanh(),
            nn.Conv2d(8, 1, kernel_size=3, padding=1),
        )

    def forward(self, u0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return u0 + t * self.correction(torch.cat([u0, t], dim=1))


def time_derivative(u: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """du/dt at every pixel (t constant per sample): J 1 by the double-vjp trick, differentiable."""
    w = torch.zeros_like(u).requires_grad_(True)
    (v,) = torch.autograd.grad(u, t, grad_outputs=w, create_graph=True)
    (du_dt,) = torch.autograd.grad(v, w, grad_outputs=torch.ones_like(t), create_graph=True)
    return du_dt


def heat_residual_loss(net: nn.Module, u0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = t.detach().requires_grad_(True)
    u = net(u0, t)
    laplacian = torch.nn.functional.conv2d(u, LAPLACIAN, padding=1)
    return (time_derivative(u, t) - KAPPA * laplacian).square().mean()


def train(net: nn.Module, u0: torch.Tensor, t: torch.Tensor) -> list[float]:
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = heat_residual_loss(net, u0, t)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    DistributedManager.initialize()
    manager = DistributedManager()
    mesh = manager.initialize_mesh((-1,), ("domain",))

    torch.manual_seed(0)
    net = HeatNet()
    reference_net = copy.deepcopy(net)
    u0 = torch.randn(BATCH, 1, HEIGHT, WIDTH)
    t = torch.rand(BATCH, 1, 1, 1).expand(BATCH, 1, HEIGHT, WIDTH).contiguous()

    u0_slabs, t_slabs = distribute_tensor(u0, mesh, [Shard(2)]), distribute_tensor(t, mesh, [Shard(2)])
    losses = train(net, u0_slabs, t_slabs)
    print_in_rank_order(f"field rows {u0_slabs.to_local().shape[2]}/{HEIGHT}; residual loss per step "
                        + " ".join(f"{loss:.4f}" for loss in losses))

    # The same training on one device (every rank runs it; the problem is small).
    reference_losses = train(reference_net, u0, t)
    loss_error = max(abs(a - b) for a, b in zip(losses, reference_losses))
    param_error = max(
        (p - q).abs().max().item() for p, q in zip(net.parameters(), reference_net.parameters())
    )
    assert loss_error < 1e-4 and param_error < 1e-4, f"sharded differs from one device: {loss_error}, {param_error}"
    assert losses[-1] < losses[0], f"the residual did not decrease: {losses}"
    # collective: also keeps rank 0 (which hosts the rendezvous store) from tearing down first
    print_in_rank_order(f"losses equal one device to {loss_error:.1e}, parameters to {param_error:.1e}")
    print0("OK 06_physics_informed: a residual with autograd derivatives, trained sharded, same as one device")
    manager.cleanup()


if __name__ == "__main__":
    main()
