"""The op library over torch's collectives instead of the host channel: the path every GPU job takes.

On one host, CPU ranks exchange through shared memory (``distributed/host_channel.py``); CUDA
tensors and NCCL never do, so every halo, all-to-all, all-gather and all-reduce of a GPU job goes
through c10d.  The rest of the suite runs mostly over the channel, so here each op family runs
under ``collectives_over_c10d`` on 2 and 3 ranks, and on 2 x 2 over H and W, with uneven shards,
against one device: output, input and parameter gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from physics_dp.shard_tensor import Shard
from physics_dp.testing import assert_sharded_matches, collectives_over_c10d, get_mesh, run_on_ranks

from ._op_cases import OPS

# mesh shape, placements and uneven splits per mesh axis of an (N, C, H, W) = (2, 8, 16, 12) field
LAYOUTS = {
    "2 ranks on H": ((2,), [Shard(2)], {0: [10, 6]}),
    "3 ranks on H": ((3,), [Shard(2)], {0: [7, 5, 4]}),
    "2x2 ranks on H and W": ((2, 2), [Shard(2), Shard(3)], {0: [10, 6], 1: [7, 5]}),
}


def _matches_over_c10d(name: str, layout: str) -> float:
    shape, placements, splits = LAYOUTS[layout]
    mesh = get_mesh(shape)
    torch.manual_seed(0)
    op = OPS[name]()
    x = torch.randn(2, 8, 16, 12)
    with collectives_over_c10d():
        report = assert_sharded_matches(op, [x], mesh, [placements], sharding_sizes=[splits], atol=1e-4, rtol=1e-5)
    return max(report.max_abs_diff.values())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_over_c10d_matches_one_device(name: str, layout: str) -> None:
    world = math.prod(LAYOUTS[layout][0])
    assert all(worst <= 1e-4 for worst in run_on_ranks(world, _matches_over_c10d, name, layout, timeout=60.0))
