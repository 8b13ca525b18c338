"""Strided token dims (issue 12, gap 2): a flatten of H x W sharded on two mesh axes keeps both shards.

Each case runs a token block (flatten, token-wise ops, attention, unflatten) sharded and on one
device: outputs, input gradients and parameter gradients must match, and the forward must send
nothing but what the ops themselves need (no all-to-all: that is how W would be gathered).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.shard_tensor.placements import StridedShard
from physics_dp.testing import assert_sharded_matches, get_mesh, run_on_ranks

# (mesh shape, placements of (N, C, H, W), split sizes per axis): uneven on every axis
LAYOUTS = {
    "2x2": ((2, 2), [Shard(2), Shard(3)], {0: (4, 3), 1: (2, 3)}),
    "W only": ((3,), [Shard(3)], {0: (1, 2, 2)}),
    "2x1x2 with batch": ((2, 1, 2), [Shard(0), Shard(2), Shard(3)], {0: (1, 1), 1: (7,), 2: (3, 2)}),
}
SHAPE = (2, 4, 7, 5)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(2).transpose(1, 2)  # (N, H*W, C)


def _untokens(t: torch.Tensor, channels: int) -> torch.Tensor:
    return t.transpose(1, 2).reshape(SHAPE[0], channels, SHAPE[2], SHAPE[3])


def _block(x, pos, w1, w2):
    """Token-wise ops of a transformer block: embedding add, norm, MLP, residual, gated sums."""
    t = _tokens(x) + pos
    h = F.layer_norm(t, (t.shape[-1],))
    h = F.linear(F.gelu(F.linear(h, w1)), w2)
    gate = t.mean(dim=1, keepdim=True)  # a sum over every token
    t = t + torch.sigmoid(gate) * h
    return _untokens(t, t.shape[-1])


def _attention(x, wq):
    t = _tokens(x)
    n, length, c = t.shape
    qkv = F.linear(t, wq).view(n, length, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    out = F.scaled_dot_product_attention(q, k, v)
    return _untokens(out.transpose(1, 2).reshape(n, length, c), c)


def _channel_mlp(x, w1, b1, w2):
    """neuraloperator's channel MLP: one-tap conv1d over the flattened H*W, stride and padding spelled out."""
    t = x.flatten(2)  # (N, C, H*W)
    h = F.conv1d(F.gelu(F.conv1d(t, w1, b1)), w2, None, 1, "valid")
    return h.reshape(SHAPE[0], -1, SHAPE[2], SHAPE[3])


def _structural(x):
    t = _tokens(x)
    stacked = torch.stack([t, 2 * t], dim=0).unsqueeze(1).squeeze(1)
    first, second = stacked.unbind(0)
    return _untokens((first * second).clone().to(torch.float64).to(torch.float32), SHAPE[1])


def _reductions(x):
    t = _tokens(x)
    return t.sum(dim=2).sum() + t.mean(dim=(0, 1)).square().sum() + t.sum() * 0.5


def _unaware(x):
    """Ops that need tokens in global order take a contiguous layout (correct, at a gather's cost)."""
    t = _tokens(x)
    wide = F.conv1d(x.flatten(2), x.new_ones(SHAPE[1], SHAPE[1], 3), padding=1)  # three taps: neighbours in global order
    return t.cumsum(dim=1) + F.scaled_dot_product_attention(t, t, t, is_causal=True) + wide.transpose(1, 2)


CASES = {
    "block": (_block, lambda g: [torch.randn(1, 35, 4, generator=g), torch.randn(8, 4, generator=g), torch.randn(4, 8, generator=g)]),
    "attention": (_attention, lambda g: [torch.randn(12, 4, generator=g)]),
    "channel mlp": (_channel_mlp, lambda g: [torch.randn(6, 4, 1, generator=g), torch.randn(6, generator=g), torch.randn(3, 6, 1, generator=g)]),
    "structural": (_structural, lambda g: []),
    "reductions": (_reductions, lambda g: []),
}


def _module_of(fn, params):
    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.params = torch.nn.ParameterList([torch.nn.Parameter(p) for p in params])

        def forward(self, x):
            return fn(x, *self.params)

    return Wrapped()


def _matches(layout, case):
    mesh_shape, placements, sizes = LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    fn, make_params = CASES[case]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=generator)
    module = _module_of(fn, make_params(generator))
    # attention's weight gradients reach ~20 here; fp32 on one device is itself 3e-5 off float64
    atol = 1e-4 if case == "attention" else 1e-5
    report = assert_sharded_matches(module, [x], mesh, [placements], sharding_sizes=[sizes], atol=atol, rtol=1e-4)
    xs = distribute_tensor(x, mesh, placements, sizes)
    with count_communication() as sent:
        module(xs)
    return report.output_placements, sorted({r.kind for r in sent.records})


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_ops_match_single_device_without_gathering(layout, case):
    mesh_shape, placements, _ = LAYOUTS[layout]
    results = run_on_ranks(math.prod(mesh_shape), _matches, layout, case, timeout=120.0)
    for output_placements, kinds in results:
        if case != "reductions":
            assert output_placements == [tuple(placements)], output_placements
        assert "all_to_all" not in kinds, kinds


def _unaware_matches(layout):
    mesh_shape, placements, sizes = LAYOUTS[layout]
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    assert_sharded_matches(_unaware, [x], get_mesh(mesh_shape), [placements], sharding_sizes=[sizes], atol=1e-5, rtol=1e-5)
    return True


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ops_that_need_global_token_order_are_exact(layout):
    run_on_ranks(math.prod(LAYOUTS[layout][0]), _unaware_matches, layout, timeout=120.0)


# ----- writes into strided tokens, and ops that contract or normalize over them ---------------------
def _written(write):
    def fn(x):
        t = _tokens(x).clone()
        write(t)
        return _untokens(t, SHAPE[1])

    return fn


WRITES = {
    "t[:, 0] = 0": lambda t: t.__setitem__((slice(None), 0), 0.0),
    "t[:, 2:9] = -1": lambda t: t.__setitem__((slice(None), slice(2, 9)), -1.0),
    "t[:, 17] = t[:, 1]": lambda t: t.__setitem__((slice(None), 17), t[:, 1].clone()),
    "t[..., 1] = 7": lambda t: t.__setitem__((Ellipsis, 1), 7.0),
    "t.index_fill_ over tokens": lambda t: t.index_fill_(1, torch.tensor([0, 9]), 2.0),
    "t.masked_fill_(t > 0.5, 0)": lambda t: t.masked_fill_(t > 0.5, 0.0),
    "t.zero_()": lambda t: t.zero_(),
    "t.copy_(t.flip(1))": lambda t: t.copy_(t.flip(1)),
    "t += t.cumsum(1)": lambda t: t.__iadd__(t.cumsum(1)),
    "t[..., :2].mul_(0) (a view)": lambda t: t[..., :2].mul_(0),
    "t.narrow(2, 2, 2).add_(1) (a view)": lambda t: t.narrow(2, 2, 2).add_(1),
}


def _w(generator, *shape):
    return torch.randn(*shape, generator=generator)


CONTRACTIONS = {
    "t @ batched plain w": lambda x, w: _tokens(x) @ w,
    "t @ t^T": lambda x, w: _tokens(x) @ _tokens(x).transpose(1, 2),
    "linear over the token dim": lambda x, w: F.linear(x.flatten(2), w[0, :3]),
    "layer_norm over the token dim": lambda x, w: F.layer_norm(x.flatten(2), (SHAPE[2] * SHAPE[3],)) * 2,
}


def _writes_and_contractions_match(layout):
    mesh_shape, placements, sizes = LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(SHAPE, generator=generator)
    for name, write in WRITES.items():
        assert_sharded_matches(_written(write), [x], mesh, [placements], sharding_sizes=[sizes], atol=1e-5, rtol=1e-5)
    w = _w(generator, SHAPE[0], SHAPE[1], 35)  # batched like the tokens: (N, C, L)
    for name, fn in CONTRACTIONS.items():
        assert_sharded_matches(_module_of(fn, [w]), [x], mesh, [placements], sharding_sizes=[sizes], atol=1e-4, rtol=1e-4)
    out = distribute_tensor(torch.zeros(SHAPE), mesh, placements, sizes).flatten(2).transpose(1, 2)
    torch.add(_tokens(distribute_tensor(x, mesh, placements, sizes)), 1, out=out)
    assert torch.equal(out.full_tensor(), _tokens(x) + 1), "out= into strided tokens"
    return True


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_writes_into_tokens_and_contractions_over_them_match(layout):
    run_on_ranks(math.prod(LAYOUTS[layout][0]), _writes_and_contractions_match, layout, timeout=120.0)


def _views_along_the_embedding_keep_the_layout():
    mesh_shape, placements, sizes = LAYOUTS["2x2"]
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    t = _tokens(distribute_tensor(x, get_mesh(mesh_shape), placements, sizes))
    views = {
        "t[..., :2]": lambda t: t[..., :2], "t[:, :, 1]": lambda t: t[:, :, 1], "t[None]": lambda t: t[None],
        "t.narrow(2, 1, 2)": lambda t: t.narrow(2, 1, 2), "t.chunk(2, -1)[1]": lambda t: t.chunk(2, -1)[1],
        "t.split([1, 3], -1)[1]": lambda t: t.split([1, 3], -1)[1],
    }
    for name, view in views.items():
        with count_communication() as sent:
            out = view(t)
        assert sent.calls == 0, (name, sent.kinds())
        assert any(type(p) is StridedShard for p in out.placements), (name, out.placements)
        assert torch.equal(out.full_tensor(), view(_tokens(x))), name
    return True


def test_views_along_the_embedding_keep_the_token_layout_and_send_nothing():
    """Before, ``t[..., :d]`` or ``t.chunk(2, -1)`` of strided tokens gathered them into a contiguous layout."""
    assert all(run_on_ranks(4, _views_along_the_embedding_keep_the_layout))


def _write_into_a_copied_view():
    mesh_shape, placements, sizes = LAYOUTS["2x2"]
    t = distribute_tensor(torch.randn(SHAPE), get_mesh(mesh_shape), placements, sizes).flatten(2).transpose(1, 2).clone()
    with pytest.raises(RuntimeError, match="writes into a view of a copy"):
        t[:, 2:9].mul_(0)
    return True


def test_a_write_into_a_view_that_is_a_copy_raises_on_every_rank():
    """A slice across the token dim is a copy (its rows live on other ranks): writing into it
    would not reach the tokens, so it raises instead of losing the write."""
    assert all(run_on_ranks(4, _write_into_a_copied_view))


def _flatten_layout():
    mesh = get_mesh((2, 2))
    x = distribute_tensor(torch.arange(2 * 3 * 7 * 5.0).reshape(2, 3, 7, 5), mesh, [Shard(2), Shard(3)], {0: (4, 3), 1: (2, 3)})
    tokens = x.flatten(2)
    coordinate = mesh.get_coordinate()
    h0, h = (0, 4) if coordinate[0] == 0 else (4, 3)
    w0, w = (0, 2) if coordinate[1] == 0 else (2, 3)
    expected_local = torch.arange(2 * 3 * 7 * 5.0).reshape(2, 3, 7, 5)[:, :, h0 : h0 + h, w0 : w0 + w].reshape(2, 3, h * w)
    torch.testing.assert_close(tokens.to_local(), expected_local)
    torch.testing.assert_close(tokens.full_tensor(), torch.arange(2 * 3 * 7 * 5.0).reshape(2, 3, 35))
    contiguous = tokens.redistribute(mesh, [Shard(2), Replicate()])
    torch.testing.assert_close(contiguous.full_tensor(), tokens.full_tensor())
    back = contiguous.redistribute(mesh, tokens.placements, sharding_sizes={0: (4, 3), 1: (2, 3)})
    torch.testing.assert_close(back.to_local(), tokens.to_local())
    return tokens.placements, tuple(tokens._spec.local_shape()), contiguous._spec.axis_sizes


def test_flatten_of_two_sharded_dims_is_strided_and_round_trips():
    for placements, local_shape, contiguous_sizes in run_on_ranks(4, _flatten_layout):
        assert placements == (StridedShard(2, (7, 5), 0), StridedShard(2, (7, 5), 1))
        assert local_shape[2] in (8, 12, 6, 9)
        assert contiguous_sizes == ((18, 17), None)  # the balanced split of 35 tokens


def _invalid(mesh_shape):
    mesh = get_mesh(mesh_shape)
    errors = []
    for placements in (
        [StridedShard(1, (3, 5), 0), StridedShard(1, (3, 4), 1)],  # factors disagree
        [StridedShard(1, (3, 5), 1), StridedShard(1, (3, 5), 1)],  # one factor twice
        [StridedShard(1, (3, 4), 0), StridedShard(1, (3, 4), 1)],  # factors do not multiply to 15
        [Shard(1), StridedShard(1, (3, 5), 1)],  # Shard and StridedShard of one dim
    ):
        try:
            ShardTensor.from_local(torch.zeros(2, 4), mesh, placements, sharding_shapes="chunk", global_shape=(2, 15))
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_inconsistent_strided_placements_are_refused():
    for errors in run_on_ranks(4, _invalid, (2, 2)):
        assert len(errors) == 4, errors


def _from_local_round_trip():
    mesh = get_mesh((2, 2))
    placements = [StridedShard(1, (3, 5), 0), StridedShard(1, (3, 5), 1)]
    full = torch.arange(30.0).reshape(2, 15)
    h0, h = (0, 2) if mesh.get_coordinate()[0] == 0 else (2, 1)
    w0, w = (0, 3) if mesh.get_coordinate()[1] == 0 else (3, 2)
    local = full.reshape(2, 3, 5)[:, h0 : h0 + h, w0 : w0 + w].reshape(2, h * w)
    st = ShardTensor.from_local(local, mesh, placements, sharding_shapes="chunk", global_shape=(2, 15))
    torch.testing.assert_close(st.full_tensor(), full)
    try:
        ShardTensor.from_local(local, mesh, placements)
    except ValueError as error:
        return str(error)
    return None


def test_from_local_with_strided_placements():
    for message in run_on_ranks(4, _from_local_round_trip):
        assert message is not None and "sharding_shapes='chunk'" in message


def _same_layout_ops(world):
    """``*_like`` factories, clones and casts on an uneven split, with DTensor's propagation forbidden."""
    import physics_dp.ops.strided as strided
    import physics_dp.shard_tensor.fallback as fallback

    mesh = get_mesh((world,))
    full = torch.randn(2, 3, 2 * world + 1, 4, generator=torch.Generator().manual_seed(3))
    sizes = tuple([1] * (world - 1) + [world + 2])
    x = distribute_tensor(full, mesh, [Shard(2)], sharding_sizes={0: sizes})
    original = fallback.propagate_and_run

    def refuse(op, args, kwargs):
        raise AssertionError(f"{op} took DTensor's sharding propagation")

    strided.propagate_and_run = fallback.propagate_and_run = refuse
    try:
        for source, plain in ((x, full), (x.transpose(2, 3), full.transpose(2, 3))):
            results = {
                "ones_like": (torch.ones_like(source), torch.ones_like(plain)),
                "zeros_like": (torch.zeros_like(source), torch.zeros_like(plain)),
                "clone": (source.clone(), plain.clone()),
                "to float64": (source.to(torch.float64), plain.to(torch.float64)),
                "contiguous clone": (source.clone(memory_format=torch.contiguous_format),
                                     plain.clone(memory_format=torch.contiguous_format)),
            }
            for name, (sharded, expected) in results.items():
                assert sharded.placements == source.placements, name
                assert sharded._spec.axis_sizes == source._spec.axis_sizes, name
                assert sharded.stride() == expected.stride(), name
                assert sharded.dtype == expected.dtype, name
                torch.testing.assert_close(sharded.full_tensor(), expected, msg=name)
            empty = torch.empty_like(source)
            assert (empty.shape, empty.stride(), empty._spec.axis_sizes) == (plain.shape, plain.stride(), source._spec.axis_sizes)
    finally:
        strided.propagate_and_run = fallback.propagate_and_run = original
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_like_factories_clones_and_casts_keep_the_layout_without_dtensor_propagation(world):
    assert all(run_on_ranks(world, _same_layout_ops, world))
