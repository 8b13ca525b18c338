"""scaled_dot_product_attention with sharded tokens: ring, q-only, kv-only; masks, causal, GQA."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops._local import ShardedOpError
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

LAYOUTS = [(1,), (2,), (3,), (4,), (2, 2)]


def _qkv(n=2, heads=2, length=13, source=13, e=8, kv_heads=None, seed=0, value_extra=0):
    """value_extra > 0 gives values a wider head than keys (the explicit, unfused block path)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, length, e, generator=gen)
    k = torch.randn(n, kv_heads or heads, source, e, generator=gen)
    v = torch.randn(n, kv_heads or heads, source, e + value_extra, generator=gen)
    return q, k, v


def _tokens(mesh):
    """Tokens over the last mesh axis; on (data, domain) the batch over the first."""
    return [Shard(2)] if mesh.ndim == 1 else [Shard(0), Shard(2)]


def _skewed(mesh, extent):
    n = mesh.size(mesh.ndim - 1)
    if n == 1:
        return None
    split = [0] + [1] * (n - 2) + [extent - (n - 2)]  # an empty first shard
    return {mesh.ndim - 1: split}


def _cases(mesh):
    t = _tokens(mesh)
    q, k, v = _qkv()
    bool_mask = torch.rand(13, 13, generator=torch.Generator().manual_seed(3)) > 0.3
    bool_mask |= torch.eye(13, dtype=torch.bool)
    add_mask = torch.randn(2, 1, 13, 13, generator=torch.Generator().manual_seed(4))
    qx, kx, vx = _qkv(length=13, source=9)
    qg, kg, vg = _qkv(heads=4, kv_heads=2)
    return {
        "ring": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [q, k, v], [t, t, t]),
        "ring_wide_values_causal": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            list(_qkv(value_extra=2)),
            [t, t, t],
        ),
        "ring_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v], [t, t, t]),
        "ring_bool_mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), [q, k, v], [t, t, t]),
        "ring_add_mask_scale": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=add_mask, scale=0.3),
            [q, k, v],
            [t, t, t],
        ),
        "ring_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), [qg, kg, vg], [t, t, t]),
        "q_sharded_kv_whole": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [qx, kx, vx], [t, None, None]),
        "q_sharded_kv_whole_causal": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            [qx, kx, vx],
            [t, None, None],
        ),
        "kv_sharded_q_whole": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [qx, kx, vx], [None, t, t]),
    }


def _run(mesh_shape, skewed):
    mesh = get_mesh(mesh_shape)
    for name, (fn, inputs, placements) in _cases(mesh).items():
        sizes = None
        if skewed:
            sizes = [None if p is None else _skewed(mesh, x.shape[2]) for x, p in zip(inputs, placements)]
        if "kv_sharded" in name and mesh.ndim == 2:
            continue  # q is plain there, so a batch-sharded key layout is not comparable
        try:
            assert_sharded_matches(fn, inputs, mesh, placements, sharding_sizes=sizes, atol=1e-5, rtol=1e-4)
        except AssertionError as error:
            raise AssertionError(f"{name} on {mesh_shape} (skewed={skewed}): {error}") from error
    return True


@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_attention_matches_single_device(mesh_shape, skewed):
    run_on_ranks(math.prod(mesh_shape), _run, mesh_shape, skewed)


def _empty_blocks_on_a_2d_mesh():
    mesh = get_mesh((2, 2))
    q, k, v = _qkv(heads=4, length=10, source=10)
    for sizes in ({0: [4, 0]}, {1: [10, 0]}, {0: [0, 4], 1: [3, 7]}):  # no heads, no rows, both
        assert_sharded_matches(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [q, k, v], mesh, [[Shard(1), Shard(2)]] * 3,
            sharding_sizes=[sizes] * 3, atol=1e-5, rtol=1e-4,
        )
    return True


def test_heads_and_tokens_split_with_an_empty_block():
    """Heads over one mesh axis and tokens over the other, a rank holding no heads or no rows: its
    blocks take the explicit path (torch's fused CPU kernel stopped the process, SIGFPE)."""
    run_on_ranks(4, _empty_blocks_on_a_2d_mesh)


def _heads_from_channels_first(grid: torch.Tensor) -> torch.Tensor:
    """Tokens of a (N, C, H, W) grid split into 2 heads: the head dim is strided (stride H*W)."""
    return grid.flatten(2).transpose(1, 2).unflatten(2, (2, -1)).transpose(1, 2)


def _strided_head_dim(world):
    mesh = get_mesh((world,))
    grid = torch.randn(2, 4, 6, 5, generator=torch.Generator().manual_seed(3))
    for keys_sharded in (True, False):  # the ring, and keys whole on every rank
        report = assert_sharded_matches(
            lambda g, kv: F.scaled_dot_product_attention(
                _heads_from_channels_first(g), _heads_from_channels_first(kv), _heads_from_channels_first(kv)
            ),
            [grid, grid.clone()],
            mesh,
            [[Shard(2)], [Shard(2)] if keys_sharded else None],
            sharding_sizes=[{0: [4, 2]} if world == 2 else None] * 2,
        )
        assert report.max_abs_diff, report
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_strided_head_dim_matches_single_device(world):
    """The fused kernels read the head dim as contiguous; they gave garbage for this view (fixed)."""
    run_on_ranks(world, _strided_head_dim, world)


def _ring_traffic(world):
    mesh = get_mesh((world,))
    q, k, v = _qkv(length=11, source=11)
    qs, ks, vs = (distribute_tensor(x, mesh, [Shard(2)]) for x in (q, k, v))
    with count_communication() as log:
        F.scaled_dot_product_attention(qs, ks, vs)
    me = mesh.get_coordinate()[0]
    sizes = ks._spec.axis_sizes[0]
    per_token = 2 * 2 * (8 + 8) * 4  # n * heads * (E_k + E_v) * fp32
    expected = sum(sizes[(me - s) % world] for s in range(world - 1)) * per_token
    return log.kinds(), log.bytes_sent, expected


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_sends_each_kv_block_around_once(world):
    for kinds, sent, expected in run_on_ranks(world, _ring_traffic, world):
        assert set(kinds) == {"p2p"} and len(kinds) == world - 1
        assert sent == expected


def _ring_backward_traffic(world):
    """What one rank sends in the ring's backward: its message kinds, bytes, and the bytes expected."""
    mesh = get_mesh((world,))
    q, k, v = _qkv(length=11, source=11)
    qs, ks, vs = (distribute_tensor(x, mesh, [Shard(2)]).requires_grad_(True) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs)
    with count_communication() as log:
        out.backward(torch.ones_like(out))
    me = mesh.get_coordinate()[0]
    sizes = ks._spec.axis_sizes[0]
    per_token = 2 * 2 * (8 + 8) * 4  # K and V rows, or their gradients: n * heads * (E_k + E_v) * fp32
    kv_blocks = sum(sizes[(me - s) % world] for s in range(world - 1))  # each K/V block goes around once
    gradient_sums = sum(sizes)  # each block's (dK, dV) sum travels every hop back to its owner
    return log.kinds(), log.bytes_sent, (kv_blocks + gradient_sums) * per_token


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_backward_sends_blocks_ahead_and_gradient_sums_behind(world):
    """K/V blocks and the (dK, dV) sums travel as separate messages (2N - 1 per rank), so each can
    be in flight while a block is computed; the bytes are those of carrying both together."""
    for kinds, sent, expected in run_on_ranks(world, _ring_backward_traffic, world):
        assert set(kinds) == {"p2p"} and len(kinds) == 2 * world - 1
        assert sent == expected


def _ring_block_routes() -> dict:
    """Messages of a ring over 1 MiB K/V blocks (2 ranks): through the host channel, or over gloo."""
    import torch.distributed as dist

    from physics_dp.distributed import host_channel

    mesh = get_mesh((2,))
    group = mesh.get_group(0)
    channel = host_channel._channels[group]
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 2048, 64, generator=generator) for _ in range(3))
    qs, ks, vs = (distribute_tensor(x, mesh, [Shard(2)]).requires_grad_(True) for x in (q, k, v))
    over_gloo = []
    saved = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: over_gloo.append(len(ops)) or saved(ops)
    try:
        before = channel._sent[1 - dist.get_rank(group)]
        out = F.scaled_dot_product_attention(qs, ks, vs)
        out.backward(torch.ones_like(out))
        through_channel = channel._sent[1 - dist.get_rank(group)] - before
    finally:
        dist.batch_isend_irecv = saved
    block_bytes = 2 * 1024 * 128 * 4  # heads * tokens * (E_k + E_v) * fp32
    return {"fits": block_bytes <= channel.message_bytes, "channel": through_channel, "gloo calls": len(over_gloo)}


def test_ring_blocks_over_the_small_slot_go_through_shared_memory_where_slots_hold_them():
    """Blocks of 1 MiB, over the 512 KiB slot of old: 4 messages per rank (1 forward, 3 backward)
    go through the host channel wherever its message slots hold them (4 MiB between 2 ranks when
    /dev/shm has room; over gloo's sockets one took 1.8 ms), else over gloo."""
    for result in run_on_ranks(2, _ring_block_routes):
        expected = {"channel": 4, "gloo calls": 0} if result["fits"] else {"channel": 0, "gloo calls": 4}
        assert {key: result[key] for key in expected} == expected, result


def _rejects_dropout():
    mesh = get_mesh((2,))
    q, k, v = (distribute_tensor(x, mesh, [Shard(2)]) for x in _qkv())
    with pytest.raises(ShardedOpError, match="dropout_p"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ShardedOpError, match="embedding dim must not be sharded"):
        F.scaled_dot_product_attention(q, k, distribute_tensor(_qkv()[2], mesh, [Shard(3)]))
    return True


def test_unsupported_attention_raises_with_reason():
    run_on_ranks(2, _rejects_dropout)


class _SelfAttention(torch.nn.Module):
    """Self-attention; with ``need_weights`` the output and the weights (averaged over heads or not)."""

    def __init__(self, causal: bool, need_weights: bool = False, average: bool = True) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.causal, self.need_weights, self.average = causal, need_weights, average

    def forward(self, x):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1) if self.causal else None
        out, weights = self.attn(
            x, x, x, need_weights=self.need_weights, attn_mask=mask, average_attn_weights=self.average
        )
        return (out, weights) if self.need_weights else out


def _mha(mesh_shape, causal):
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(2, 11, 8)
    placements = [Shard(1)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    for need_weights, average in ((False, True), (True, True), (True, False)):
        torch.manual_seed(0)
        module = _SelfAttention(causal, need_weights, average)
        assert_sharded_matches(module, [x], mesh, [placements], atol=1e-5, rtol=1e-4)
    return True


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_multihead_attention_module_matches_single_device(mesh_shape, causal):
    run_on_ranks(math.prod(mesh_shape), _mha, mesh_shape, causal)


def _functional_mha_with_a_bool_mask(x: torch.Tensor, need_weights: bool):
    """``F.multi_head_attention_forward`` called directly: its bool mask marks what may *not* be attended."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(8, 2)
    mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
    t = x.transpose(0, 1)
    out, weights = F.multi_head_attention_forward(
        t, t, t, 8, 2, module.in_proj_weight, module.in_proj_bias, None, None, False, 0.0,
        module.out_proj.weight, module.out_proj.bias, training=False, attn_mask=mask, need_weights=need_weights,
    )
    return (out, weights) if need_weights else out


def _functional_mha(world: int) -> bool:
    x = torch.randn(2, 11, 8, generator=torch.Generator().manual_seed(0))
    for need_weights in (False, True):
        fn = functools.partial(_functional_mha_with_a_bool_mask, need_weights=need_weights)
        assert_sharded_matches(fn, [x], get_mesh((world,)), [[Shard(1)]], atol=1e-5, rtol=1e-4)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_functional_mha_bool_mask_masks_what_torch_masks(world):
    """It was passed to SDPA as it was, where True means *attend*: the mask was inverted (off by 1.09)."""
    run_on_ranks(world, _functional_mha, world)


def _bf16_ring(world: int, value_dim: int) -> float:
    """bf16 through the ring: with a value head size unlike the key's (4) the explicit block path,
    whose log-sum-exp is kept in fp32; with equal sizes (8) the fused CPU kernel per block, the
    query gradient summed over blocks in fp32.  Both stay within bf16 rounding of one device."""
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 13, 8, generator=gen) for _ in range(2))
    v = torch.randn(1, 2, 13, value_dim, generator=gen)
    inputs = [t.to(torch.bfloat16) for t in (q, k, v)]
    report = assert_sharded_matches(
        F.scaled_dot_product_attention, inputs, mesh, [[Shard(2)]] * 3, atol=5e-2, rtol=5e-2
    )
    return report.worst if hasattr(report, "worst") else 0.0


@pytest.mark.parametrize("world, value_dim", [(2, 4), (2, 8), (3, 8)])
def test_bf16_ring_matches_single_device(world, value_dim):
    run_on_ranks(world, _bf16_ring, world, value_dim)


def _three_dim_tokens(world):
    mesh = get_mesh((world,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 9, 8) for _ in range(3))
    for causal in (False, True):
        fn = functools.partial(F.scaled_dot_product_attention, is_causal=causal)
        assert_sharded_matches(fn, [q, k, v], mesh, [[Shard(1)]] * 3, atol=1e-5, rtol=1e-4)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_three_dim_inputs_without_a_head_dim(world):
    """(batch, tokens, dim) inputs, which torch accepts: the fused kernels take 4-D only (it crashed)."""
    run_on_ranks(world, _three_dim_tokens, world)


def _under_autocast(world: int) -> bool:
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 13, 8, generator=gen) for _ in range(3))
    cotangent = torch.randn(1, 2, 13, 8, generator=gen)
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    sharded = [distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.scaled_dot_product_attention(*plain)
        out = F.scaled_dot_product_attention(*sharded)
    assert out.dtype == expected.dtype == torch.bfloat16  # cast as torch casts, before the ring
    expected.backward(cotangent.to(torch.bfloat16))
    out.backward(distribute_tensor(cotangent.to(torch.bfloat16), mesh, out.placements))
    torch.testing.assert_close(out.full_tensor(), expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(sharded, plain):
        assert got.grad.dtype == torch.float32  # the leaves' dtype: the cast is differentiated
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, atol=3e-2, rtol=3e-2)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_autocast_casts_before_the_ring_as_torch_does(world):
    run_on_ranks(world, _under_autocast, world)
