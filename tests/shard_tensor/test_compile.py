"""torch.compile(fullgraph=True) of sharded blocks of every op family equals eager and compiles once.

Each block runs eagerly, then compiled for three training steps (forward, a mean-square loss,
backward) on the same sharded input: the output, the input gradient and every parameter
gradient equal eager's, and the second and third steps add no graph (Dynamo's unique-graph
counter stays at one).  ``aot_eager`` traces the same forward and backward graphs inductor
compiles (every collective functional, in the graph); the conv block also runs through
inductor's C++ code generation, pooled down to fewer rows than ranks on 3 ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from physics_dp.shard_tensor import Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

LAYOUTS = [(1,), (2,), (3,), (2, 2)]

pytestmark = pytest.mark.usefixtures("fresh_rank_processes")


class _Lambda(nn.Module):
    """A parameterized block whose forward is a plain function (the op family under test)."""

    def __init__(self, fn: Callable, channels: int = 4) -> None:
        super().__init__()
        self.fn = fn
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x * self.scale)


class _ChannelMLP(nn.Module):
    """One-tap conv1d over flattened H*W (strided tokens on 2-D meshes), as in neuraloperator's FNO."""

    def __init__(self) -> None:
        super().__init__()
        self.mix_in, self.mix_out = nn.Conv1d(4, 6, 1), nn.Conv1d(6, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix_out(F.gelu(self.mix_in(x.flatten(2)))).view(x.shape)


def _conv_block() -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 4, 3, padding=1))


class _ChannelsLast(nn.Module):
    """A block run channels last: its weights, and its input made so inside the graph."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x.contiguous(memory_format=torch.channels_last))


def _zero_where_large(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y[y > 0.5] = 0.0
    return y


def _fft(x: torch.Tensor) -> torch.Tensor:
    return torch.fft.fft2(x).abs()


def _attention(x: torch.Tensor) -> torch.Tensor:
    tokens = x.flatten(2).transpose(1, 2)  # (N, L, C)
    q = k = v = tokens.unflatten(2, (2, 2)).transpose(1, 2)  # (N, heads, L, 2)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "conv_groupnorm_silu_conv": _conv_block,
    "conv_strided_and_circular": lambda: nn.Sequential(
        nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
    ),
    "conv_transpose": lambda: nn.Sequential(nn.ConvTranspose2d(4, 4, 2, stride=2), nn.ConvTranspose2d(4, 4, 4, stride=2, padding=1)),
    "conv_groupnorm_silu_conv_channels_last": lambda: _ChannelsLast(_conv_block()),
    "batch_norm": lambda: nn.BatchNorm2d(4),
    "layer_norm_over_chw": lambda: nn.LayerNorm([4, 12, 8]),
    "layer_norm_over_chw_without_affine": lambda: nn.LayerNorm([4, 12, 8], elementwise_affine=False),
    "instance_norm": lambda: nn.InstanceNorm2d(4, affine=True),
    "pooling": lambda: nn.Sequential(nn.AvgPool2d(2), nn.MaxPool2d(3, stride=1, padding=1)),
    "interpolation": lambda: _Lambda(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")),
    "interpolation_through_fewer_rows_than_ranks": lambda: _Lambda(
        lambda x: F.interpolate(F.interpolate(x, size=(2, 4), mode="bilinear"), scale_factor=4, mode="bilinear")
    ),
    "pad_reflect": lambda: _Lambda(lambda x: F.pad(x, (1, 1, 2, 2), mode="reflect")),
    "pixel_shuffle_and_back": lambda: _Lambda(lambda x: F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2)),
    "softmax_over_h": lambda: _Lambda(lambda x: F.softmax(x, 2) + F.log_softmax(x, 2)),
    "unfold_and_fold": lambda: _Lambda(lambda x: F.fold(F.unfold(x, 3, padding=1) / 9, x.shape[-2:], 3, padding=1)),
    "fft2": lambda: _Lambda(_fft),
    "reductions": lambda: _Lambda(lambda x: x - x.mean(dim=(2, 3), keepdim=True) + x.amax(dim=2, keepdim=True)),
    "views_and_linear": lambda: nn.Sequential(_Lambda(lambda x: x.permute(0, 2, 3, 1).flatten(1, 2)), nn.Linear(4, 6)),
    "attention": lambda: _Lambda(_attention),
    "channel_mlp_on_tokens": lambda: _ChannelMLP(),
    "activations_with_untagged_gradients": lambda: _Lambda(lambda x: F.relu6(3 * x) + F.hardswish(x) + F.prelu(x, torch.full((4,), 0.2))),
    "loss_scaled_output": lambda: _Lambda(lambda x: x * F.mse_loss(x, x.detach() * 0.5)),
    "patches_by_tensor_unfold": lambda: _Lambda(lambda x: x.unfold(2, 2, 2).unfold(3, 2, 2).flatten(-2).sum(-1)),
    "row_selected_on_a_sharded_dim": lambda: _Lambda(lambda x: x * x[:, :, 5].unsqueeze(2)),
    "cross_entropy_over_the_grid": lambda: _Lambda(lambda x: x * F.cross_entropy(x, x.detach().argmax(1))),
    "scans_and_topk": lambda: _Lambda(lambda x: x.cumsum(2) + x.topk(2, 2).values.sum(2, keepdim=True)),
    "buckets": lambda: _Lambda(lambda x: x * torch.bucketize(x.detach(), torch.tensor([-0.5, 0.0, 0.5]))),
    "in_place_views": lambda: _Lambda(lambda x: (x * 2).unsqueeze_(0).transpose_(3, 4).squeeze_(0).transpose(2, 3)),
    "quantile_over_h": lambda: _Lambda(lambda x: x - torch.quantile(x, 0.3, dim=2, keepdim=True)),
    "mask_assignment_of_a_value": lambda: _Lambda(_zero_where_large),
}

INDUCTOR_BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "conv_groupnorm_pools_to_fewer_rows_than_ranks": lambda: nn.Sequential(
        *_conv_block(), nn.AvgPool2d(2), nn.Conv2d(4, 4, 3, padding=1), nn.AdaptiveAvgPool2d((3, 3)),
        nn.Conv2d(4, 4, 3, padding=1), nn.MaxPool2d(2, stride=2, ceil_mode=True),
    ),
}


def _placements(mesh_shape: tuple[int, ...]) -> list:
    return [Shard(2)] if len(mesh_shape) == 1 else [Shard(2), Shard(3)]


def _sizes(mesh_shape: tuple[int, ...]) -> dict[int, list[int]] | None:
    """An uneven split of the 12 rows on 3 ranks; balanced elsewhere."""
    return {0: [5, 4, 3]} if mesh_shape == (3,) else None


def _train_step(model: nn.Module, x: ShardTensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = model(x)
    out.square().mean().backward()
    return out


def _compiled_against_eager(name: str, mesh_shape: tuple[int, ...], backend: str) -> dict:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    eager = {**BLOCKS, **INDUCTOR_BLOCKS}[name]()
    compiled_model = copy.deepcopy(eager)
    x = torch.randn(2, 4, 12, 8)
    xe = distribute_tensor(x, mesh, _placements(mesh_shape), _sizes(mesh_shape)).requires_grad_()
    xc = distribute_tensor(x, mesh, _placements(mesh_shape), _sizes(mesh_shape)).requires_grad_()
    out_eager = _train_step(eager, xe)

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()  # the rank processes are reused across tests
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    graphs = []
    for _ in range(3):
        out = _train_step(compiled, xc)
        graphs.append(counters["stats"]["unique_graphs"])
    diffs = {
        "output": (out.full_tensor() - out_eager.full_tensor()).abs().max().item(),
        "input grad": (xc.grad.full_tensor() - xe.grad.full_tensor()).abs().max().item(),
    }
    for (pname, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
        diffs[pname] = (pc.grad - pe.grad).abs().max().item()
    return {"diffs": diffs, "graphs": graphs, "type": type(out).__name__, "rows": out.to_local().shape[2]}


def _check(results: list[dict], atol: float = 1e-5) -> None:
    for result in results:
        assert result["type"] == "ShardTensor", result
        assert result["graphs"] == [1, 1, 1], f"steps 2 and 3 recompiled: {result}"
        assert max(result["diffs"].values()) <= atol, result


@pytest.mark.parametrize("mesh_shape", LAYOUTS, ids=str)
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_fullgraph_compile_equals_eager(name: str, mesh_shape: tuple[int, ...]) -> None:
    world = 1
    for size in mesh_shape:
        world *= size
    _check(run_on_ranks(world, _compiled_against_eager, name, mesh_shape, "aot_eager", timeout=120))


def test_inductor_compiles_when_a_rank_holds_no_output_rows() -> None:
    """Inductor's generated C++ (CPU) runs the sharded conv block (fp32 reassociation allows ~1e-6),
    then pools down to 2 rows for 3 ranks: a rank's backward depends on no tangent data there, and
    its collectives must still pair with the other ranks' (see ``tracing.kept_in_backward``)."""
    results = run_on_ranks(
        3, _compiled_against_eager, "conv_groupnorm_pools_to_fewer_rows_than_ranks", (3,), "inductor", timeout=300
    )
    assert sorted(result["rows"] for result in results) == [0, 1, 1]
    _check(results, 1e-5)


def _cache_keys() -> tuple[str, str]:
    mesh = get_mesh((2,))
    x = distribute_tensor(torch.zeros(2, 4, 8, 8), mesh, [Shard(2)])
    return x._stable_hash_for_caching(), distribute_tensor(torch.zeros(2, 4, 8, 8), mesh, [Shard(2)])._stable_hash_for_caching()


def test_compiled_graph_cache_keys_differ_between_ranks() -> None:
    """Ranks share inductor's on-disk cache, but each traces its own graph (its neighbours, its rows):
    the same layout must give each rank its own key, and the same key again on the same rank."""
    (first_0, again_0), (first_1, again_1) = run_on_ranks(2, _cache_keys)
    assert first_0 == again_0 and first_1 == again_1
    assert first_0 != first_1


def _conversions_compiled(mesh_shape: tuple[int, ...]) -> dict:
    from physics_dp.shard_tensor import Replicate

    mesh = get_mesh(mesh_shape)
    placements, sizes = _placements(mesh_shape), _sizes(mesh_shape)
    x = torch.randn(2, 4, 12, 8)
    xe = distribute_tensor(x, mesh, placements, sizes).requires_grad_()
    xc = distribute_tensor(x, mesh, placements, sizes).requires_grad_()
    shapes = xe._spec.sharding_shapes()

    def fn(t: ShardTensor) -> torch.Tensor:
        slab = t.to_local() * 2
        rebuilt = ShardTensor.from_local(slab, mesh, placements, sharding_shapes=shapes)
        whole = rebuilt.redistribute(placements=[Replicate()] * len(mesh_shape))
        return (whole.to_local() * whole.to_local()).sum() + rebuilt.full_tensor().mean()

    fn(xe).backward()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled, graphs = torch.compile(fn, backend="aot_eager", fullgraph=True), []
    for _ in range(3):
        xc.grad = None
        out = compiled(xc)
        out.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    return {"graphs": graphs, "grad": (xc.grad.full_tensor() - xe.grad.full_tensor()).abs().max().item(),
            "out": (out - fn(xe)).abs().item()}


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)], ids=str)
def test_conversions_compile_without_graph_breaks(mesh_shape: tuple[int, ...]) -> None:
    """to_local, from_local (sizes stated), redistribute and full_tensor inside fullgraph, with gradients."""
    world = 1
    for size in mesh_shape:
        world *= size
    for result in run_on_ranks(world, _conversions_compiled, mesh_shape):
        assert result["graphs"] == [1, 1, 1], result
        assert result["grad"] <= 1e-5 and result["out"] <= 1e-4, result
