"""Tutorial 5: an inverse problem: optimize a sharded field through a model, domain-parallel.

Run:

    torchrun --standalone --nproc-per-node 3 examples/minimal/05_inverse_problem.py

Data assimilation, inverse problems and learned initial conditions optimize the *input* of a
model. Here the field is a ShardTensor leaf split along its height: its gradient comes back in
the same split, so each rank holds (and an ordinary `torch.optim` optimizer updates) only its
slab of the field, of the gradient and of the optimizer state: about 1/N of the whole each.
The recovered field equals the one found on a single device.
"""

from __future__ import annotations

import torch
from torch import nn

from physics_dp import DistributedManager, Shard, ShardTensor
from physics_dp.shard_tensor import distribute_tensor

from _print import print0, print_in_rank_order

HEIGHT, WIDTH, STEPS = 23, 16, 40  # 23 rows: uneven on 2, 3 and 4 ranks


class Smoother(nn.Module):
    """A frozen forward model: two diffusion-like 3x3 stencils with a nonlinearity between."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(1, 4, kernel_size=3, padding=1, padding_mode="circular")
        self.second = nn.Conv2d(4, 1, kernel_size=3, padding=1)
        self.requires_grad_(False)

    def forward(self, field: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(field)))


def recover(field: torch.Tensor, observed: torch.Tensor, model: nn.Module, check=None) -> torch.Tensor:
    """Fit ``field`` so the model's output matches ``observed`` (plus a small smoothness prior)."""
    optimizer = torch.optim.Adam([field], lr=0.05)
    for _ in range(STEPS):
        optimizer.zero_grad()
        misfit = (model(field) - observed).square().mean()
        roughness = (field[:, :, :, 1:] - field[:, :, :, :-1]).square().mean()
        (misfit + 1e-2 * roughness).backward()
        if check is not None:
            check(field)
        optimizer.step()
    return field.detach()


def slab_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def main() -> None:
    DistributedManager.initialize()
    manager = DistributedManager()
    mesh = manager.initialize_mesh((-1,), ("domain",))

    torch.manual_seed(0)
    model = Smoother()
    truth = torch.randn(1, 1, HEIGHT, WIDTH)
    observed = model(truth) + 0.01 * torch.randn(1, 1, HEIGHT, WIDTH)
    guess = torch.zeros(1, 1, HEIGHT, WIDTH)

    # Each rank makes only its own rows of the first guess (distribute_tensor would keep a view
    # of the global tensor alive, scatter_tensor would send the rows from one rank).
    rows = torch.tensor_split(torch.arange(HEIGHT), manager.world_size)[manager.rank].numel()
    field = ShardTensor.from_local(torch.zeros(1, 1, rows, WIDTH), mesh, [Shard(2)]).requires_grad_(True)
    observed_slabs = distribute_tensor(observed, mesh, [Shard(2)])
    global_bytes = guess.numel() * guess.element_size()
    seen: list[int] = []

    def gradient_is_a_slab(leaf: torch.Tensor) -> None:
        # the gradient is split like the field, and its memory is this rank's slab, no more
        assert leaf.grad.placements == leaf.placements and leaf.grad._spec == leaf._spec, leaf.grad
        seen.append(slab_bytes(leaf.grad.to_local()))
        assert seen[-1] == slab_bytes(leaf.to_local()), (seen[-1], slab_bytes(leaf.to_local()))

    recovered = recover(field, observed_slabs, model, check=gradient_is_a_slab)
    field_bytes = slab_bytes(field.to_local())
    assert field_bytes == rows * WIDTH * guess.element_size()
    print_in_rank_order(
        f"field rows {rows}/{HEIGHT}: field slab {field_bytes} B, gradient slab {max(seen)} B "
        f"of {global_bytes} B global ({field_bytes / global_bytes:.2f} of the whole; 1/N = {1 / manager.world_size:.2f})"
    )

    # The same optimization on one device (every rank runs it; the problem is small).
    reference = recover(guess.clone().requires_grad_(True), observed, model)
    error = (recovered.full_tensor() - reference).abs().max().item()
    assert error < 1e-4, f"sharded and single-device fields differ by {error}"
    fit = (recovered.full_tensor() - truth).square().mean().item() / truth.square().mean().item()
    # collective: also keeps rank 0 (which hosts the rendezvous store) from tearing down first
    print_in_rank_order(f"recovered field equals the single-device one to {error:.1e}; relative misfit {fit:.3f}")
    print0("OK 05_inverse_problem: sharded field, slab-sized gradients, same result as one device")
    manager.cleanup()


if __name__ == "__main__":
    main()
