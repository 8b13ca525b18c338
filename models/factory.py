"""Build a backbone from plain keyword options (as a YAML config gives them), no Hydra needed.

Config files hold lists where the dataclasses want tuples, and leave the grid size to the data;
this module is the one place that reconciles them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from .dit import DiT, DiTConfig
from .song_unet import SongUNet, SongUNetConfig
from .stormcast import StormCastUNet

__all__ = ["ARCHITECTURES", "build_backbone", "build_regression_unet"]

ARCHITECTURES = ("unet", "dit")


def _tuples(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, Sequence) and not isinstance(v, str) else v for k, v in options.items()}


def _unet_config(grid_shape: Sequence[int], in_channels: int, out_channels: int, cond_channels: int, options) -> SongUNetConfig:
    return SongUNetConfig(
        img_resolution=int(grid_shape[0]),
        in_channels=in_channels,
        out_channels=out_channels,
        cond_channels=cond_channels,
        **_tuples(options),
    )


def build_backbone(
    architecture: str,
    *,
    grid_shape: Sequence[int],
    in_channels: int,
    out_channels: int,
    cond_channels: int = 0,
    options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A noise-conditioned backbone ``net(x, noise_labels, condition)``: ``"unet"`` (SongUNet) or
    ``"dit"`` (DiT) for a (H, W) = ``grid_shape`` field; ``options`` are the config's own fields."""
    options = dict(options or {})
    if architecture == "unet":
        return SongUNet(_unet_config(grid_shape, in_channels, out_channels, cond_channels, options))
    if architecture == "dit":
        return DiT(
            DiTConfig(
                input_size=(int(grid_shape[0]), int(grid_shape[1])),
                in_channels=in_channels,
                out_channels=out_channels,
                cond_channels=cond_channels,
                **_tuples(options),
            )
        )
    raise ValueError(f"unknown architecture {architecture!r}; choose one of {ARCHITECTURES}")


def build_regression_unet(
    *, grid_shape: Sequence[int], in_channels: int, out_channels: int, cond_channels: int = 0, options: Mapping[str, Any] | None = None
) -> StormCastUNet:
    """The StormCast regression U-Net for a (H, W) = ``grid_shape`` field."""
    return StormCastUNet(_unet_config(grid_shape, in_channels, out_channels, cond_channels, dict(options or {})))
