"""Whole models' sharded code on one GPU (skipped without one; CI has none).

The op tests check each handler on CUDA; here the StormCast U-Net, SongUNet (with attention) and
DiT run every layer's sharded code on a 1-rank mesh (``sharded_code_on_size_one_axes``), forward
and backward against the plain model in fp32 (TF32 off on both sides), and a training step must
not make the host wait for the GPU from physics_dp's code.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed import DistributedManager
from physics_dp.models import build_regression_unet
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import assert_sharded_matches, sharded_code_on_size_one_axes

from .test_dit import _tiny as tiny_dit
from .test_song_unet import _inputs as song_unet_inputs
from .test_song_unet import _tiny as tiny_song_unet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STORMCAST = dict(model_channels=8, channel_mult=[1, 2, 2], num_blocks=1, attn_resolutions=[], num_heads=1)


def _stormcast() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = build_regression_unet(grid_shape=(30, 20), in_channels=3, out_channels=3, cond_channels=2, options=STORMCAST)
    gen = torch.Generator().manual_seed(1)
    return model, [torch.randn(2, 3, 30, 20, generator=gen), torch.randn(2, 2, 30, 20, generator=gen)]


def _song_unet() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    return tiny_song_unet(), list(song_unet_inputs(16, 12))


def _dit() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    return tiny_dit(), list(song_unet_inputs(16, 12))


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, list[torch.Tensor]]]] = {
    "stormcast regression": _stormcast,
    "song_unet": _song_unet,
    "dit": _dit,
}


def _on_gpu(make: Callable[[], tuple[torch.nn.Module, list[torch.Tensor]]]) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    device = DistributedManager().device
    model, inputs = make()
    return model.to(device), [t.to(device) for t in inputs]


def _placements(inputs: list[torch.Tensor]) -> list:
    """Fields (4-D) sharded on H; noise labels and the like passed as they are."""
    return [[Shard(2)] if t.ndim == 4 else None for t in inputs]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_sharded_on_one_gpu_equals_plain(name: str, one_gpu_mesh, full_fp32) -> None:
    model, inputs = _on_gpu(MODELS[name])
    with sharded_code_on_size_one_axes():
        report = assert_sharded_matches(model, inputs, one_gpu_mesh, _placements(inputs), atol=1e-4, rtol=1e-4)
    assert len(report.max_abs_diff) > len(list(model.parameters()))  # the output, input and parameter grads compared


def _waits_from_physics_dp(step: Callable[[], None]) -> list[str]:
    """The host waits for the GPU during ``step`` whose stack passes through physics_dp."""
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "/physics_dp/" in f.filename]
        if frames:
            sites.append(f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}")

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sharded_training_step_never_waits_for_the_gpu(name: str, one_gpu_mesh) -> None:
    model, inputs = _on_gpu(MODELS[name])
    with sharded_code_on_size_one_axes():
        sharded = [distribute_tensor(t, one_gpu_mesh, p) if p else t for t, p in zip(inputs, _placements(inputs))]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(*sharded).square().mean().backward()

    step()  # the first call builds caches
    assert _waits_from_physics_dp(step) == []
