"""DiT: unsharded shape, layout and size checks, and sharded == single device on 1-D and 2-D meshes."""

from __future__ import annotations

import math

import pytest
import torch

from physics_dp.models.dit import DiT, DiTConfig, sincos_pos_embed_2d
from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Shard, balanced_sizes, distribute_tensor
from physics_dp.testing import assert_sharded_matches, get_mesh, run_on_ranks

from .test_song_unet import _inputs

TINY = dict(
    input_size=(16, 12),
    patch_size=2,
    in_channels=2,
    out_channels=2,
    cond_channels=1,
    hidden_size=16,
    depth=2,
    num_heads=2,
    frequency_embedding_size=16,
)
TINY_PARAMETERS = 11896


def _tiny(seed: int = 0, randomize_zero_init: bool = True, **overrides) -> DiT:
    """A tiny DiT; adaLN-Zero leaves whole layers at zero, so by default give those random values
    (otherwise the output is identically zero and most gradients vanish)."""
    torch.manual_seed(seed)
    model = DiT(DiTConfig(**{**TINY, **overrides}))
    if randomize_zero_init:
        with torch.no_grad():
            for p in model.parameters():
                if not p.any():
                    p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("size", [(16, 12), (16, 16), (8, 20)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_shape_unsharded(size):
    model = _tiny(input_size=size)
    x, labels, condition = _inputs(*size)
    assert model(x, labels, condition).shape == (2, 2, *size)


def test_fresh_model_outputs_zero():
    """adaLN-Zero: the final linear and every modulation start at zero."""
    x, labels, condition = _inputs(16, 12)
    assert torch.equal(_tiny(randomize_zero_init=False)(x, labels, condition), torch.zeros_like(x))


def test_condition_and_size_are_checked():
    x, labels, condition = _inputs(16, 12)
    with pytest.raises(ValueError, match="condition"):
        _tiny()(x, labels)
    with pytest.raises(ValueError, match="cond_channels=0"):
        _tiny(cond_channels=0)(x, labels, condition)
    with pytest.raises(ValueError, match="input_size"):
        _tiny()(*_inputs(16, 16))
    with pytest.raises(ValueError, match="divisible by patch_size"):
        DiTConfig(**{**TINY, "input_size": (16, 13)})
    with pytest.raises(ValueError, match="num_heads"):
        DiTConfig(**{**TINY, "num_heads": 3})


def test_unpatchify_inverts_patch_layout():
    """Tokens in flatten(2) order with (p, p, C) features unpatchify to the original field."""
    model = _tiny()
    p, (height, width) = 2, (16, 12)
    x = torch.randn(3, 2, height, width)
    tokens = x.reshape(3, 2, height // p, p, width // p, p).permute(0, 2, 4, 3, 5, 1).reshape(3, -1, p * p * 2)
    assert torch.equal(model.unpatchify(tokens, height, width), x)


def test_position_embedding_non_square():
    gh, gw, dim = 5, 3, 8
    emb = sincos_pos_embed_2d(dim, gh, gw)
    assert emb.shape == (gh * gw, dim)
    # Token r * gw + c (flatten(2) order) holds the row code in the first half, the column code in the second.
    rows, cols = emb.view(gh, gw, dim).split(dim // 2, dim=2)
    assert torch.equal(rows, rows[:, :1].expand_as(rows)) and torch.equal(cols, cols[:1].expand_as(cols))
    assert len({tuple(t.tolist()) for t in emb}) == gh * gw  # every patch position distinct
    model = _tiny(input_size=(10, 6), randomize_zero_init=False)
    assert model.pos_embed.shape == (1, gh * gw, 16)
    assert torch.equal(model.pos_embed[0], sincos_pos_embed_2d(16, gh, gw))


def test_num_parameters():
    model = _tiny()
    assert model.num_parameters() == sum(p.numel() for p in model.parameters()) == TINY_PARAMETERS
    model.pos_embed.requires_grad_(False)
    assert model.num_parameters(trainable_only=True) == TINY_PARAMETERS - model.pos_embed.numel()
    assert _tiny(hidden_size=32).num_parameters() > TINY_PARAMETERS
    assert _tiny(depth=1).num_parameters() < TINY_PARAMETERS


def _placements(mesh):
    return [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]


def _sharded_matches(mesh_shape, height, width):
    mesh = get_mesh(mesh_shape)
    model = _tiny(input_size=(height, width))
    x, labels, condition = _inputs(height, width)
    p = _placements(mesh)
    report = assert_sharded_matches(model, [x, labels, condition], mesh, [p, None, p], atol=1e-4, rtol=1e-4)
    return max(report.max_abs_diff.values()), report.output_placements


LAYOUTS = [(1,), (2,), (3,), (4,), (2, 2)]


@pytest.mark.parametrize("size", [(16, 16), (16, 12)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
def test_sharded_matches_single_device(mesh_shape, size):
    results = run_on_ranks(math.prod(mesh_shape), _sharded_matches, mesh_shape, *size, timeout=120.0)
    assert all(worst <= 1e-4 for worst, _ in results)
    if len(mesh_shape) == 1:
        # The output stays domain-sharded like the input (no silent gather to a replicated result).
        assert all(placements == [(Shard(2),)] for _, placements in results), results
    # 2-D meshes: see test_2d_mesh_output_keeps_both_shards.


def test_2d_mesh_output_keeps_both_shards():
    """Tokens of an H x W decomposition are strided (each rank's block, flattened): nothing is
    gathered, and the unpatchify view restores both shards."""
    results = run_on_ranks(4, _sharded_matches, (2, 2), 16, 12, timeout=120.0)
    assert all(placements == [(Shard(2), Shard(3))] for _, placements in results), results


def _ring_bytes(blocks: list[int], me: int, row_bytes: int, width: int) -> tuple[int, int]:
    """Bytes rank ``me`` sends in one ring attention, forward and backward: blocks of ``blocks[o]``
    tokens (o = owner), ``row_bytes`` per token and head-dim column; k|v forward, k|v|dk|dv back
    (only dk|dv on the last hop home)."""
    size = len(blocks)
    forward = sum(blocks[(me - s) % size] * 2 * width for s in range(size - 1)) * row_bytes
    backward = sum(blocks[(me - s) % size] * (4 if s < size - 1 else 2) * width for s in range(size)) * row_bytes
    return forward, backward


def _dit_2x2_traffic(height, width):
    mesh = get_mesh((2, 2))
    model = _tiny(input_size=(height, width))
    x, labels, condition = _inputs(height, width)
    xs = distribute_tensor(x, mesh, [Shard(2), Shard(3)]).requires_grad_(True)
    with count_communication() as forward:
        out = model(xs, labels, condition)
    with count_communication() as backward:
        out.backward(torch.ones_like(out))
    return [(r.kind, r.bytes_sent) for r in forward.records], [(r.kind, r.bytes_sent) for r in backward.records]


@pytest.mark.parametrize("size", [(16, 12), (12, 20)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_2d_mesh_sends_only_ring_attention_and_gradient_sums(size):
    """The DiT on a 2 x 2 mesh: forward sends exactly ring attention's blocks (no all-gather or
    all-to-all of W); backward adds only parameter gradients: all-reduced sums, and the
    positional embedding's gradient assembled from each rank's block of tokens."""
    height, width = size
    cfg = {**TINY, "input_size": size}
    grid = (height // cfg["patch_size"], width // cfg["patch_size"])
    rows, cols = balanced_sizes(grid[0], 2), balanced_sizes(grid[1], 2)
    blocks = [rows[r // 2] * cols[r % 2] for r in range(4)]  # tokens per rank, in global-rank order
    head_dim = cfg["hidden_size"] // cfg["num_heads"]
    row_bytes = 2 * cfg["num_heads"] * 4  # batch 2, fp32
    results = run_on_ranks(4, _dit_2x2_traffic, height, width, timeout=120.0)
    model = _tiny(input_size=size)
    parameter_bytes = sum(p.numel() for p in model.parameters()) * 4
    for me, (forward, backward) in enumerate(results):
        ring_forward, ring_backward = _ring_bytes(blocks, me, row_bytes, head_dim)
        assert {kind for kind, _ in forward} == {"p2p"}, forward
        assert sum(n for _, n in forward) == cfg["depth"] * ring_forward
        assert {kind for kind, _ in backward} == {"p2p", "all_reduce", "all_to_all"}, backward
        assert sum(n for kind, n in backward if kind == "p2p") == cfg["depth"] * ring_backward
        assert sum(n for kind, n in backward if kind == "all_reduce") <= parameter_bytes
        assert sum(n for kind, n in backward if kind == "all_to_all") < model.pos_embed.numel() * 4
