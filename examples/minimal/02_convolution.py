"""Tutorial 2: an unmodified conv net on a field split along its height, forward and backward.

Run:

    torchrun --standalone --nproc-per-node 2 examples/minimal/02_convolution.py

The model below is plain PyTorch. Handed a ShardTensor, each layer exchanges exactly what it
needs: convolutions fetch a halo of neighbour rows, GroupNorm merges per-rank statistics, avg
pooling and interpolation gather the few rows their windows reach. The result, the input
gradient and every parameter gradient equal the single-device ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from physics_dp import DistributedManager, Shard
from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import distribute_tensor
from physics_dp.testing import assert_sharded_matches

from _print import print0, print_in_rank_order

BATCH, CHANNELS, HEIGHT, WIDTH = 2, 3, 22, 16  # 22 rows: uneven on 3 or 4 ranks


class SmallConvNet(nn.Module):
    """Conv -> GroupNorm -> SiLU -> 2x avg pool -> bilinear 2x upsample -> conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(CHANNELS, 8, kernel_size=3, padding=1)
        self.norm = nn.GroupNorm(num_groups=2, num_channels=8)
        self.pool = nn.AvgPool2d(kernel_size=2)
        self.conv_out = nn.Conv2d(8, CHANNELS, kernel_size=3, padding=1, padding_mode="circular")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.silu(self.norm(self.conv_in(x))))
        h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        return self.conv_out(h)


def main() -> None:
    DistributedManager.initialize()
    manager = DistributedManager()
    mesh = manager.initialize_mesh((-1,), ("domain",))

    # Every rank builds the same model and the same global input (same seed). In a real job you
    # would build the model once and broadcast it (physics_dp.nn.sync_module_over_mesh).
    torch.manual_seed(0)
    model = SmallConvNet()
    field = torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH)

    # Split the height (dim 2) over the ranks and run the model as usual.
    x = distribute_tensor(field, mesh, [Shard(2)]).requires_grad_(True)
    with count_communication() as forward_log:
        y = model(x)
    with count_communication() as backward_log:
        y.square().mean().backward()
    print_in_rank_order(
        f"input rows {x.to_local().shape[2]}, output rows {y.to_local().shape[2]} of {y.shape[2]}; "
        f"sent {forward_log.bytes_sent} B in {forward_log.calls} calls forward "
        f"({', '.join(sorted(set(forward_log.kinds()))) or 'none'}), "
        f"{backward_log.bytes_sent} B backward"
    )
    # The output is still split along the height, but its split may differ from the input's:
    # each output row belongs to the rank owning the centre of its receptive field (the strided
    # pool moves some boundaries). Later ops carry whatever split they receive.
    assert y.placements == (Shard(2),) and y.shape == (BATCH, CHANNELS, HEIGHT, WIDTH)

    # The first conv alone: a 3x3 kernel needs one row from each neighbour. One row of the
    # (2, 3, ., 16) float32 input is 2*3*16*4 = 384 bytes, sent as one p2p message per neighbour.
    with count_communication() as halo_log:
        model.conv_in(x)
    neighbours = int(manager.rank > 0) + int(manager.rank < manager.world_size - 1)
    row_bytes = BATCH * CHANNELS * WIDTH * field.element_size()
    assert halo_log.kinds() == ["p2p"] * neighbours, halo_log.kinds()
    assert halo_log.bytes_sent == neighbours * row_bytes, halo_log.bytes_sent
    print_in_rank_order(f"conv_in halo: {neighbours} neighbour(s) x {row_bytes} B = {halo_log.bytes_sent} B")

    # Single-device comparison of outputs, input gradients and parameter gradients. It builds
    # the sharded input itself from the global one and runs a copy of the model unsharded.
    # Float32 sums run in a different order when split (per-rank partial sums of the GroupNorm
    # statistics and of the weight gradients), so results agree to rounding, not bit for bit.
    model.zero_grad()
    report = assert_sharded_matches(model, [field], mesh, [[Shard(2)]], atol=1e-4, rtol=1e-4)
    worst = max(report.max_abs_diff, key=report.max_abs_diff.get)
    print0(
        f"compared {len(report.max_abs_diff)} tensors with one device; largest difference "
        f"{report.max_abs_diff[worst]:.2e} ({worst})"
    )

    print0("OK 02_convolution: outputs, input grads and parameter grads match one device")
    manager.cleanup()


if __name__ == "__main__":
    main()
