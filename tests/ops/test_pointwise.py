"""Pointwise ops on operands laid out differently: torch's result layout, read once per layout, nothing sent."""

from __future__ import annotations

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops import pointwise
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

# (name, global operands from a (2, 6, 5, 4) tensor and a second one): layouts whose result is
# not simply contiguous, as a training step meets them (a concatenation's gradient slice added to a
# gradient, a transposed operand, channels-last against contiguous)
CASES = {
    "channel slice + contiguous": lambda a, b: (a[:, :3], b[:, 3:].contiguous()),
    "transposed + contiguous": lambda a, b: (a.transpose(2, 3), b.transpose(2, 3).contiguous()),
    "channels last + contiguous": lambda a, b: (a.contiguous(memory_format=torch.channels_last), b),
}


def _result_layout_matches_torch(world: int, case: str) -> bool:
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(0)
    full_a, full_b = torch.randn(2, 6, 5, 4, generator=gen), torch.randn(2, 6, 5, 4, generator=gen)
    make = CASES[case]
    plain_x, plain_y = make(full_a, full_b)
    expected = torch.add(plain_x, plain_y, alpha=2.0)
    shard_a = distribute_tensor(full_a, mesh, [Shard(2)])
    shard_b = distribute_tensor(full_b, mesh, [Shard(2)])
    x, y = make(shard_a, shard_b)
    pointwise._result_strides_seen.clear()
    meta_runs = 0
    real = pointwise._as_meta

    def counting(value):
        nonlocal meta_runs
        meta_runs += isinstance(value, torch.Tensor)
        return real(value)

    pointwise._as_meta = counting
    try:
        with count_communication() as log:
            first = torch.add(x, y, alpha=2.0)
            again = torch.add(x, y, alpha=3.0)  # same layouts, another scalar: no second meta run
    finally:
        pointwise._as_meta = real
    assert meta_runs == 2, meta_runs  # both operands, once
    assert log.calls == 0, log.kinds()  # each rank computes its block from its own slabs
    assert first.stride() == expected.stride() and again.stride() == expected.stride()
    torch.testing.assert_close(first.full_tensor(), expected)
    torch.testing.assert_close(again.full_tensor(), torch.add(plain_x, plain_y, alpha=3.0))
    return True


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_result_layout_is_torchs_and_read_once_per_layout(world, case):
    run_on_ranks(world, _result_layout_matches_torch, world, case)
