"""Tutorial 4: teach physics_dp your own op -- a 5-point Laplacian with one halo exchange.

Run:

    torchrun --standalone --nproc-per-node 2 examples/minimal/04_custom_op.py

``my_laplacian`` is an ordinary function on (batch, channels, H, W) tensors. We register a
handler so that, called on a ShardTensor, it runs as: fetch one halo row from each neighbour
(physics_dp.ops.halo.halo_exchange_nd), apply the plain stencil to the widened slab, wrap the
result as a ShardTensor with the input's split. Gradients flow through the halo exchange, whose
backward returns each halo row's gradient to the rank that owns the row.

Without the handler this function would still run sharded, op by op (F.pad exchanges the halo,
slicing and adds are local). A handler is how you take control: one exchange for the whole
stencil, a local kernel of your choice (a fused or compiled one), and a clear error for layouts
you do not support. Use the same pattern for ops physics_dp cannot shard by itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_unary

from physics_dp import DistributedManager, Shard, ShardTensor
from physics_dp.distributed.collectives import count_communication
from physics_dp.ops.halo import halo_exchange_nd
from physics_dp.shard_tensor import distribute_tensor
from physics_dp.testing import assert_sharded_matches

from _print import print0, print_in_rank_order

BATCH, CHANNELS, HEIGHT, WIDTH = 2, 3, 17, 12  # 17 rows: uneven on 2, 3 and 4 ranks
H_DIM, W_DIM = 2, 3


def _stencil(padded: torch.Tensor) -> torch.Tensor:
    """The 5-point Laplacian of the interior of a tensor padded by one row/column on each side."""
    centre = padded[..., 1:-1, 1:-1]
    return (
        padded[..., :-2, 1:-1] + padded[..., 2:, 1:-1] + padded[..., 1:-1, :-2] + padded[..., 1:-1, 2:]
        - 4.0 * centre
    )


def my_laplacian(x: torch.Tensor) -> torch.Tensor:
    """5-point Laplacian over the last two dims, with zero values beyond the boundary.

    The two ``torch.overrides`` lines make this function take part in ``__torch_function__``:
    given a ShardTensor it calls the handler registered for it instead of the body below.
    """
    if has_torch_function_unary(x):
        return handle_torch_function(my_laplacian, (x,), x)
    return _stencil(F.pad(x, (1, 1, 1, 1)))


def sharded_laplacian(func, types, args, kwargs) -> ShardTensor:
    """Handler for ``my_laplacian`` on a ShardTensor: one halo exchange, then the plain stencil.

    Signature (func, types, args, kwargs) as for ``__torch_function__``.
    """
    (x,) = args
    if any(p.is_partial() for p in x.placements):
        raise ValueError(
            f"my_laplacian needs the values of the field, but its input has placements {x.placements}; "
            "redistribute it to Shard/Replicate first, e.g. x.redistribute(placements=[Replicate()])"
        )
    spec = x._spec  # the split of every sharded dim; the halo exchange plans its messages from it
    # Widen H and W by one row/column on each side. Sharded dims get their rows from the
    # neighbours (p2p, only the rows needed); dims held whole are padded locally. "constant"
    # with value 0 is the zero boundary beyond the global edges.
    padded = halo_exchange_nd(x.to_local(), spec, {H_DIM: (1, 1), W_DIM: (1, 1)}, mode="constant", value=0.0)
    out = _stencil(padded)  # plain tensor, same shape as this rank's slab
    # Same global shape and split as the input: state the split so nothing needs discovering.
    # to_local and from_local are differentiable, so autograd connects input and output.
    return ShardTensor.from_local(out, x.device_mesh, x.placements, sharding_shapes=spec.sharding_shapes())


ShardTensor.register_function_handler(my_laplacian, sharded_laplacian)


def main() -> None:
    DistributedManager.initialize()
    manager = DistributedManager()
    mesh = manager.initialize_mesh((-1,), ("domain",))
    torch.manual_seed(0)
    field = torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH)

    # Values and input gradients compared with one device, H split (balanced).
    report = assert_sharded_matches(my_laplacian, [field], mesh, [[Shard(H_DIM)]])
    print0(f"H split: largest difference from one device {max(report.max_abs_diff.values()):.2e}")

    # A skewed split: the last rank holds all rows but one per other rank, so the first ranks'
    # halos reach past one-row neighbours. Then the W dim instead of H.
    world = manager.world_size
    skewed = [1] * (world - 1) + [HEIGHT - (world - 1)]
    assert_sharded_matches(my_laplacian, [field], mesh, [[Shard(H_DIM)]], sharding_sizes=[{0: skewed}])
    assert_sharded_matches(my_laplacian, [field], mesh, [[Shard(W_DIM)]])

    # What the handler sends: one row of (batch, channels, W) values to each neighbour, plus the
    # tiny all-gather with which from_local checks that every rank states the same explicit split
    # (ranks disagreeing would otherwise fail later, inside some collective).
    x = distribute_tensor(field, mesh, [Shard(H_DIM)])
    with count_communication() as log:
        y = my_laplacian(x)
    neighbours = int(manager.rank > 0) + int(manager.rank < world - 1)
    row_bytes = BATCH * CHANNELS * WIDTH * field.element_size()
    halo_bytes = sum(r.bytes_sent for r in log.records if r.kind == "p2p")
    assert halo_bytes == neighbours * row_bytes, (log.records, neighbours * row_bytes)
    assert [r.kind for r in log.records if r.kind != "p2p"] == ["all_gather_sizes"], log.records
    assert isinstance(y, ShardTensor) and y.placements == (Shard(H_DIM),)
    assert y.to_local().shape == x.to_local().shape  # the handler keeps the input's split
    torch.testing.assert_close(y.full_tensor(), my_laplacian(field))
    # For comparison, the function body run op by op on the ShardTensor (no handler): also
    # exact, but the slices of the padded tensor have different splits, so the adds re-split
    # rows (all-to-alls), and the result's split can differ from the input's.
    with count_communication() as generic_log:
        generic = _stencil(F.pad(x, (1, 1, 1, 1)))
    torch.testing.assert_close(generic.full_tensor(), y.full_tensor())
    print_in_rank_order(
        f"rows {x.to_local().shape[H_DIM]}: handler sent {log.bytes_sent} B in {log.calls} message(s); "
        f"op by op: {generic_log.bytes_sent} B in {generic_log.calls} call(s), "
        f"rows {x.to_local().shape[H_DIM]} -> {generic.to_local().shape[H_DIM]}"
    )

    print0("OK 04_custom_op: the registered my_laplacian matches one device, forward and backward")
    manager.cleanup()


if __name__ == "__main__":
    main()
