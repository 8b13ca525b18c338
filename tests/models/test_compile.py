"""torch.compile(fullgraph=True) of the StormCast regression U-Net, SongUNet and DiT, sharded.

Three training steps of the compiled model on a sharded grid equal eager (output, input
gradient, every parameter gradient) and compile one graph.  ``aot_eager`` traces the forward
and backward graphs inductor would compile, every collective functional and in the graph.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo
from torch import nn

from physics_dp.models import StormCastUNet
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

from .test_dit import _tiny as _tiny_dit
from .test_song_unet import _inputs
from .test_song_unet import _tiny as _tiny_song_unet

pytestmark = pytest.mark.usefixtures("fresh_rank_processes")


def _stormcast_unet() -> nn.Module:
    torch.manual_seed(0)
    return StormCastUNet(
        img_resolution=16, in_channels=2, out_channels=2, cond_channels=1, model_channels=8, channel_mult=(1, 2),
        num_blocks=1, attn_resolutions=(8,), num_heads=2,
    )


def _model_and_inputs(name: str, height: int, width: int) -> tuple[nn.Module, list[torch.Tensor | None]]:
    x, labels, condition = _inputs(height, width)
    if name == "stormcast_unet":
        return _stormcast_unet(), [x, condition]
    if name == "song_unet":
        return _tiny_song_unet(), [x, labels, condition]
    return _tiny_dit(input_size=(height, width)), [x, labels, condition]


def _step(model: nn.Module, inputs: list) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    for value in inputs:
        if value is not None and value.requires_grad:
            value.grad = None
    out = model(*inputs)
    out.square().mean().backward()
    return out


def _compiled_against_eager(name: str, mesh_shape: tuple[int, ...]) -> dict:
    mesh = get_mesh(mesh_shape)
    placements = [Shard(2)] if len(mesh_shape) == 1 else [Shard(2), Shard(3)]
    eager, inputs = _model_and_inputs(name, 16, 12)
    compiled_model = copy.deepcopy(eager)

    def shard(value):
        if value is None or value.ndim < 4:
            return value
        return distribute_tensor(value, mesh, placements).requires_grad_()

    inputs_eager, inputs_compiled = [shard(v) for v in inputs], [shard(v) for v in inputs]
    out_eager = _step(eager, inputs_eager)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    graphs = []
    for _ in range(3):
        out = _step(compiled, inputs_compiled)
        graphs.append(counters["stats"]["unique_graphs"])
    diffs = {
        "output": (out.full_tensor() - out_eager.full_tensor()).abs().max().item(),
        "input grad": (inputs_compiled[0].grad.full_tensor() - inputs_eager[0].grad.full_tensor()).abs().max().item(),
    }
    for (pname, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
        if pe.grad is not None:
            diffs[pname] = (pc.grad - pe.grad).abs().max().item()
    return {"diffs": diffs, "graphs": graphs}


# Every layout meets every model's kinds of op somewhere (DiT is cheap to compile: it runs on all
# of them); the two U-Nets, a minute each per layout here, take the layouts that differ most.
CASES = [
    ("stormcast_unet", (3,)), ("stormcast_unet", (2, 2)), ("song_unet", (2,)),
    ("dit", (1,)), ("dit", (2,)), ("dit", (3,)), ("dit", (2, 2)),
]


@pytest.mark.parametrize("name, mesh_shape", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_fullgraph_compile_equals_eager(name: str, mesh_shape: tuple[int, ...]) -> None:
    for result in run_on_ranks(math.prod(mesh_shape), _compiled_against_eager, name, mesh_shape, timeout=300):
        assert result["graphs"] == [1, 1, 1], f"steps 2 and 3 recompiled: {result}"
        worst = max(result["diffs"].values())
        assert worst <= 1e-4, result
