"""sharded_code_on_size_one_axes: a 1-rank axis runs the sharded code inside the block, the plain op outside."""

from __future__ import annotations

import torch
import torch.nn as nn

from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks, sharded_code_on_size_one_axes


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
