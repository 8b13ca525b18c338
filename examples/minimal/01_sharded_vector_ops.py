"""Tutorial 1: ShardTensor basics -- split a tensor over ranks and use it like a normal tensor.

Run (any number of processes; 13 rows never divide evenly, which is the point):

    torchrun --standalone --nproc-per-node 2 examples/minimal/01_sharded_vector_ops.py

A ShardTensor is a torch.Tensor whose *global* value is split over a device mesh: every rank
holds one slab (``to_local()``), while ``shape``, reductions and printing refer to the whole
tensor.  Every check below compares against the same computation on one plain tensor.
"""

from __future__ import annotations

import torch

from physics_dp import DistributedManager, Replicate, Shard, ShardTensor, scatter_tensor
from physics_dp.shard_tensor import distribute_tensor

from _print import print0, print_in_rank_order


def main() -> None:
    # 1. Join the job. torchrun (or SLURM) variables are read from the environment; run with
    #    plain `python` and it becomes a one-process job, so this script works either way.
    DistributedManager.initialize()
    manager = DistributedManager()
    # A 1-D mesh over all ranks; -1 means "however many processes there are".
    mesh = manager.initialize_mesh((-1,), ("domain",))
    print0(f"world size {manager.world_size}, mesh {mesh}")

    # 2. The same global tensor on every rank (same seed), split along dim 0 (rows).
    #    distribute_tensor slices locally: nothing is sent.
    torch.manual_seed(0)
    field = torch.randn(13, 6)
    x = distribute_tensor(field, mesh, [Shard(0)])
    # The global shape is (13, 6) everywhere; the slab is each rank's share of the rows. The
    # default split is torch.tensor_split's: balanced, larger slabs first (13 on 3 -> 5, 4, 4).
    print_in_rank_order(f"x.shape={tuple(x.shape)} local={tuple(x.to_local().shape)} offsets={x.offsets()}")
    assert x.shape == field.shape
    row0 = x.offsets()[0]
    assert torch.equal(x.to_local(), field[row0 : row0 + x.to_local().shape[0]])

    # 3. scatter_tensor: only rank 0 holds the data (e.g. it read the file); every rank
    #    receives just its own slab. Same layout as distribute_tensor.
    source = field if manager.rank == 0 else None
    y = scatter_tensor(source, 0, mesh, [Shard(0)])
    assert torch.equal(y.to_local(), x.to_local())

    # 4. Pointwise ops run on the slabs alone: no communication, the layout is kept.
    z = torch.sin(x) * 2.0 + x**2 - 1.0
    assert isinstance(z, ShardTensor) and z.placements == (Shard(0),)
    torch.testing.assert_close(z.full_tensor(), torch.sin(field) * 2.0 + field**2 - 1.0)

    # 5. Reductions are global. A full reduction returns a Replicate tensor: the same value on
    #    every rank (one small all-reduce). Means divide by the global count, even when uneven.
    total, mean = x.sum(), x.mean()
    assert total.placements == (Replicate(),)
    torch.testing.assert_close(total.full_tensor(), field.sum())
    torch.testing.assert_close(mean.full_tensor(), field.mean())
    torch.testing.assert_close(x.max().full_tensor(), field.max())
    # Reducing the sharded dim -> replicated; reducing another dim keeps the rows sharded.
    torch.testing.assert_close(x.mean(dim=0).full_tensor(), field.mean(dim=0))
    per_row = x.sum(dim=1)
    assert per_row.placements == (Shard(0),)
    torch.testing.assert_close(per_row.full_tensor(), field.sum(dim=1))
    print0(f"sum={total.full_tensor().item():.4f} mean={mean.full_tensor().item():.4f} (match one device)")

    # 6. Any split you like: here every rank but the last holds a single row. The split is
    #    kept through every op, and results do not depend on it.
    world = manager.world_size
    skewed_sizes = [1] * (world - 1) + [13 - (world - 1)]
    skewed = distribute_tensor(field, mesh, [Shard(0)], sharding_sizes={0: skewed_sizes})
    print_in_rank_order(f"skewed split {skewed_sizes}: local rows={skewed.to_local().shape[0]}")
    torch.testing.assert_close(skewed.mean().full_tensor(), field.mean())
    torch.testing.assert_close((skewed * 3).var(dim=0).full_tensor(), (field * 3).var(dim=0))

    # 7. to_local vs full_tensor: to_local() is this rank's slab (free); full_tensor() gathers
    #    the whole tensor onto every rank (communication: use it for checks and output only).
    assert torch.equal(x.full_tensor(), field)

    # 8. redistribute changes the layout. To Replicate: every rank holds everything...
    replicated = x.redistribute(placements=[Replicate()])
    assert torch.equal(replicated.to_local(), field)
    # ...to Shard(1): split the 6 columns instead (one all-to-all; 4 ranks -> 2, 2, 1, 1).
    by_column = x.redistribute(placements=[Shard(1)])
    print_in_rank_order(f"after redistribute to Shard(1): local={tuple(by_column.to_local().shape)}")
    col0 = by_column.offsets()[1]
    assert torch.equal(by_column.to_local(), field[:, col0 : col0 + by_column.to_local().shape[1]])

    # 9. from_local: each rank already has its own rows (say, read from its own file), of any
    #    size. "infer" asks every rank for its slab size (one tiny all-gather).
    rows = manager.rank + 1
    local = torch.full((rows, 6), float(manager.rank))
    assembled = ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes="infer")
    expected = torch.cat([torch.full((r + 1, 6), float(r)) for r in range(world)])
    assert assembled.shape == expected.shape
    assert torch.equal(assembled.full_tensor(), expected)

    print0("OK 01_sharded_vector_ops: every result matches the single-device computation")
    manager.cleanup()


if __name__ == "__main__":
    main()
