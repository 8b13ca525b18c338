"""One case per sharded op family, for the tests that run the whole op library on another path
(CUDA tensors; c10d collectives instead of the host channel).  Each builds a fresh module or
function of an (N, 8, H, W) field sharded on H."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def _attention(t: torch.Tensor) -> torch.Tensor:
    tokens = t.flatten(2).transpose(1, 2).unsqueeze(1)  # (N, 1, H*W, C): H-sharded tokens
    return F.scaled_dot_product_attention(tokens, tokens, tokens)


OPS: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "conv2d": lambda: nn.Conv2d(8, 8, 3, padding=1),
    "conv2d stride 2": lambda: nn.Conv2d(8, 8, 3, stride=2, padding=1),
    "conv_transpose2d": lambda: nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1),
    "group_norm": lambda: nn.GroupNorm(2, 8),
    "batch_norm": lambda: nn.BatchNorm2d(8),
    "layer_norm": lambda: nn.LayerNorm([8, 16, 12]),
    "avg_pool2d": lambda: lambda t: F.avg_pool2d(t, 2),
    "max_pool2d": lambda: lambda t: F.max_pool2d(t, 3, 1, 1),
    "interpolate bilinear": lambda: lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"),
    "interpolate nearest": lambda: lambda t: F.interpolate(t, scale_factor=2),
    "pad circular": lambda: lambda t: F.pad(t, (2, 2, 2, 2), mode="circular"),
    "pad reflect": lambda: lambda t: F.pad(t, (1, 1, 1, 1), mode="reflect"),
    "fft2": lambda: lambda t: torch.fft.fft2(t).abs(),
    "rfft2": lambda: lambda t: torch.fft.rfft2(t).abs(),
    "attention": lambda: _attention,
    "var over H, W": lambda: lambda t: t.var((2, 3)),
    "amax over H": lambda: lambda t: t.amax(2),
    "softmax over H": lambda: lambda t: t.softmax(2),
    "pointwise chain": lambda: lambda t: F.silu(t * 2 + 1) * t,
    "index_select over H": lambda: lambda t: t.index_select(2, torch.tensor([0, 3, 7], device=t.device)),
}
