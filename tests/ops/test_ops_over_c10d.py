"""The op library over torch's collectives instead of the host channel: the path every GPU job takes.

On one host, CPU ranks exchange through shared memory (``distributed/host_channel.py``); CUDA
tensors and NCCL never do, so every halo, all-to-all, all-gather and all-reduce of a GPU job goes
through c10d.  The rest of the suite runs mostly over the channel, so here each op family runs on
``collectives_over_c10d``, on 2 and 3
ranks with uneven shards, against one device: output, input and parameter gradients.
"""

from __future__ import annotations

import pytest
import torch

from physics_dp.shard_tensor import Shard
from physics_dp.testing import assert_sharded_matches, collectives_over_c10d, get_mesh, run_on_ranks

from ._op_cases import OPS

SPLITS = {2: [10, 6], 3: [7, 5, 4]}  # uneven rows of H = 16


def _matches_over_c10d(name: str, world: int) -> float:
    mesh = get_mesh((world,))
    torch.manual_seed(0)
    op = OPS[name]()
    x = torch.randn(2, 8, 16, 12)
    with collectives_over_c10d():
        report = assert_sharded_matches(op, [x], mesh, [[Shard(2)]], sharding_sizes=[{0: SPLITS[world]}], atol=1e-4, rtol=1e-5)
    return max(report.max_abs_diff.values())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_over_c10d_matches_one_device(name: str, world: int) -> None:
    assert all(worst <= 1e-4 for worst in run_on_ranks(world, _matches_over_c10d, name, world, timeout=60.0))
