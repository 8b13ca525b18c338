"""Tutorial 3: attention over a sequence split across ranks (ring attention).

Run:

    torchrun --standalone --nproc-per-node 2 examples/minimal/03_attention.py

When q, k and v are split along the token dim, every query still needs every key. physics_dp
passes the key/value blocks around the ranks in a ring: each rank attends to one block at a
time and merges the partial results exactly (log-sum-exp), so no rank ever holds all keys or
the full score matrix. Causal masks use global token positions, so uneven splits are exact.
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

BATCH, HEADS, TOKENS, HEAD_DIM = 2, 2, 21, 8  # 21 tokens: uneven on 2 and 4 ranks
EMBED = HEADS * HEAD_DIM


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the same function runs on ShardTensors and on ordinary tensors."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SelfAttention(nn.Module):
    """nn.MultiheadAttention as a self-attention layer on (batch, tokens, embed) inputs.

    need_weights=False is required when sharded: the (tokens x tokens) weight matrix is exactly
    what ring attention never builds.
    """

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def main() -> None:
    DistributedManager.initialize()
    manager = DistributedManager()
    mesh = manager.initialize_mesh((-1,), ("domain",))
    torch.manual_seed(0)

    # 1. scaled_dot_product_attention on (batch, heads, tokens, head_dim), tokens (dim 2) split.
    q, k, v = (torch.randn(BATCH, HEADS, TOKENS, HEAD_DIM) for _ in range(3))
    qs, ks, vs = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))
    with count_communication() as log:
        out = causal_attention(qs, ks, vs)
    print_in_rank_order(
        f"holds tokens {qs.offsets()[2]}..{qs.offsets()[2] + qs.to_local().shape[2] - 1}; "
        f"ring sent {log.bytes_sent} B in {log.calls} p2p messages"
    )
    # The ring passes blocks to the next rank: at hop h, rank r forwards the k and v block that
    # started on rank r - h, for h = 0 .. world - 2 (one packed p2p message per hop). So each
    # rank sends every block except its successor's, and the bytes follow from the split alone.
    world, rank = manager.world_size, manager.rank
    tokens_per_rank = [len(c) for c in torch.tensor_split(torch.arange(TOKENS), world)]
    token_bytes = 2 * BATCH * HEADS * HEAD_DIM * q.element_size()  # one token of k and of v
    expected = sum(tokens_per_rank[(rank - hop) % world] for hop in range(world - 1)) * token_bytes
    assert log.kinds() == ["p2p"] * (world - 1) and log.bytes_sent == expected, (log.records, expected)
    assert out.placements == (Shard(2),)
    torch.testing.assert_close(out.full_tensor(), causal_attention(q, k, v), atol=1e-5, rtol=1e-5)

    # The same check with gradients of q, k and v (the backward runs the ring again and
    # carries each block's dK/dV home to its owner).
    report = assert_sharded_matches(causal_attention, [q, k, v], mesh, [[Shard(2)]] * 3)
    print0(f"sdpa: largest difference from one device {max(report.max_abs_diff.values()):.2e}")

    # 2. nn.MultiheadAttention on (batch, tokens, embed), tokens (dim 1) split. The in/out
    #    projections run locally per token; the attention in between is the ring above.
    layer = SelfAttention()
    x = torch.randn(BATCH, TOKENS, EMBED)
    report = assert_sharded_matches(layer, [x], mesh, [[Shard(1)]])
    print0(
        f"MultiheadAttention: compared {len(report.max_abs_diff)} tensors (output, input and parameter "
        f"grads); largest difference {max(report.max_abs_diff.values()):.2e}"
    )

    print0("OK 03_attention: ring attention and nn.MultiheadAttention match one device")
    manager.cleanup()


if __name__ == "__main__":
    main()
