"""The GPU job's paths where tests run: sharded code on a 1-rank axis; c10d collectives instead of the host channel."""

from __future__ import annotations

import platform

import torch
import torch.nn as nn

from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import collectives_over_c10d, get_mesh, run_on_ranks, sharded_code_on_size_one_axes


def _graph_nodes(t: torch.Tensor) -> set[str]:
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(parent for parent, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def _group_norm_graph_and_difference(inside: bool) -> tuple[set[str], float]:
    mesh = get_mesh((1,))
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, 4)
    x = torch.randn(1, 4, 8, 6)
    plain_x = x.clone().requires_grad_()
    norm(plain_x).square().sum().backward()
    if inside:
        with sharded_code_on_size_one_axes():
            sharded = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    else:
        sharded = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    out = norm(sharded)
    out.square().sum().backward()
    return _graph_nodes(out), (sharded.grad.full_tensor() - plain_x.grad).abs().max().item()


def test_a_size_one_axis_runs_the_sharded_code_inside_the_block_only():
    (inside_nodes, inside_diff), = run_on_ranks(1, _group_norm_graph_and_difference, True)
    (outside_nodes, outside_diff), = run_on_ranks(1, _group_norm_graph_and_difference, False)
    assert "_ChannelNormBackward" in inside_nodes and "NativeGroupNormBackward0" not in inside_nodes
    assert "NativeGroupNormBackward0" in outside_nodes and "_ChannelNormBackward" not in outside_nodes
    assert inside_diff < 1e-5 and outside_diff < 1e-5


def _channel_inside_and_outside() -> tuple[bool, bool, bool, float]:
    from physics_dp.distributed import collectives, host_channel

    group = get_mesh((2,)).get_group(0)
    channel = host_channel.open_channel(group)  # None where shared memory is unavailable
    with collectives_over_c10d():
        inside = host_channel.channel_for(group, torch.ones(4), None) is not None
        inside = inside or host_channel.opened_channel(group, torch.device("cpu"), 16) is not None
        total = collectives.all_reduce(torch.ones(4), "sum", group)  # through c10d, and right
    outside = host_channel.channel_for(group, torch.ones(4), None) is channel
    return channel is not None, inside, outside, total.sum().item()


def test_no_collective_uses_the_host_channel_inside_collectives_over_c10d():
    results = run_on_ranks(2, _channel_inside_and_outside)
    for has_channel, inside, outside, total in results:
        assert not inside and outside and total == 8
    # on the channel's platforms the block had a channel to bypass
    assert all(r[0] for r in results) or platform.machine().lower() not in ("x86_64", "amd64")
