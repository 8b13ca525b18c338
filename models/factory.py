"""Build a backbone from plain keyword options (as a YAML config gives them), no Hydra needed.

Config files hold lists where the dataclasses want tuples, and leave the grid size to the data;
this module is the one place that reconciles them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from .dit import DiT, DiTConfig
from .padding import PadToMultiple
from .song_unet import SongUNet, SongUNetConfig
from .stormcast import StormCastUNet

__all__ = ["ARCHITECTURES", "build_backbone", "build_regression_unet", "grid_multiple"]

ARCHITECTURES = ("unet", "dit")


def _tuples(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, Sequence) and not isinstance(v, str) else v for k, v in options.items()}


def grid_multiple(architecture: str, options: Mapping[str, Any] | None = None) -> int:
    """What H and W must divide by: 2**(levels - 1) for the U-Net, the patch size for the DiT."""
    options = dict(options or {})
    if architecture == "unet":
        return 2 ** (len(options.get("channel_mult", SongUNetConfig.channel_mult)) - 1)
    if architecture == "dit":
        return int(options.get("patch_size", DiTConfig.patch_size))
    raise ValueError(f"unknown architecture {architecture!r}; choose one of {ARCHITECTURES}")


def _padded(grid_shape: Sequence[int], multiple: int) -> tuple[int, int]:
    return tuple(-(-int(n) // multiple) * multiple for n in grid_shape[:2])  # type: ignore[return-value]


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
    ``"dit"`` (DiT) for a (H, W) = ``grid_shape`` field, behind :class:`PadToMultiple` so any grid
    works; ``options`` are the config's own fields."""
    options = dict(options or {})
    multiple = grid_multiple(architecture, options)
    padded = _padded(grid_shape, multiple)
    if architecture == "unet":
        net: nn.Module = SongUNet(_unet_config(padded, in_channels, out_channels, cond_channels, options))
    else:
        net = DiT(
            DiTConfig(
                input_size=padded,
                in_channels=in_channels,
                out_channels=out_channels,
                cond_channels=cond_channels,
                **_tuples(options),
            )
        )
    return PadToMultiple(net, multiple)


def build_regression_unet(
    *, grid_shape: Sequence[int], in_channels: int, out_channels: int, cond_channels: int = 0, options: Mapping[str, Any] | None = None
) -> PadToMultiple:
    """The StormCast regression U-Net for a (H, W) = ``grid_shape`` field (padded as needed)."""
    options = dict(options or {})
    multiple = grid_multiple("unet", options)
    config = _unet_config(_padded(grid_shape, multiple), in_channels, out_channels, cond_channels, options)
    return PadToMultiple(StormCastUNet(config), multiple)
