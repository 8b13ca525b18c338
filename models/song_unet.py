"""EDM-style SongUNet for 2-D fields (N, C, H, W), in plain PyTorch.

A U-Net of residual blocks with a sinusoidal noise embedding, self-attention at chosen
resolutions and skip connections concatenated on the channel dim (Karras et al. 2022,
"Elucidating the Design Space of Diffusion-Based Generative Models", after Song et al. 2021).

The model knows nothing about sharding: it uses only ordinary torch ops, so it runs unchanged
on ``ShardTensor`` inputs split over H and/or W. Two conventions keep it shard-friendly:

- spatial maps are turned into tokens with ``x.flatten(2).transpose(1, 2)`` ((N, C, H, W) ->
  (N, HW, C)) and back with ``transpose(1, 2).reshape(N, C, H, W)``;
- the noise embedding lives on plain (N, D) tensors and is broadcast into a feature map as
  ``x + emb[:, :, None, None]``.

``img_resolution`` is the input height H; ``attn_resolutions`` lists the heights (H halved per
level) at which blocks attend. H must be divisible by ``2 ** (len(channel_mult) - 1)``; W must be
too, and W may differ from H.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SongUNet", "SongUNetConfig"]


@dataclass(frozen=True)
class SongUNetConfig:
    """Hyper-parameters of :class:`SongUNet`."""

    img_resolution: int = 64  # input height H; decides where attention sits
    in_channels: int = 1
    out_channels: int = 1
    cond_channels: int = 0  # extra input channels concatenated to x
    model_channels: int = 128
    channel_mult: tuple[int, ...] = (1, 2, 2, 2)
    num_blocks: int = 4  # residual blocks per level (encoder); the decoder has one more
    attn_resolutions: tuple[int, ...] = (16,)
    embedding_dim: int | None = None  # width of the noise embedding; default 4 * model_channels
    num_heads: int = 1
    downsample: str = "conv"  # "conv" (stride-2 3x3 conv) or "pool" (avg_pool2d(2))
    skip_scale: float = math.sqrt(0.5)  # residual sum scaling, as in EDM

    def __post_init__(self) -> None:
        if self.downsample not in ("conv", "pool"):
            raise ValueError(f"downsample must be 'conv' or 'pool', got {self.downsample!r}")
        if not self.channel_mult:
            raise ValueError("channel_mult must not be empty")
        factor = 2 ** (len(self.channel_mult) - 1)
        if self.img_resolution % factor:
            raise ValueError(f"img_resolution {self.img_resolution} is not divisible by {factor}")

    @property
    def emb_dim(self) -> int:
        return self.embedding_dim or 4 * self.model_channels


def _group_norm(channels: int, min_channels_per_group: int = 4, max_groups: int = 32) -> nn.GroupNorm:
    groups = max(1, min(max_groups, channels // min_channels_per_group))
    while channels % groups:
        groups -= 1
    return nn.GroupNorm(groups, channels, eps=1e-6)


class PositionalEmbedding(nn.Module):
    """Sinusoidal embedding of a (N,) tensor of noise labels into (N, num_channels)."""

    def __init__(self, num_channels: int, max_positions: int = 10000):
        super().__init__()
        if num_channels % 2:
            raise ValueError(f"num_channels must be even, got {num_channels}")
        self.num_channels = num_channels
        self.max_positions = max_positions

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        half = self.num_channels // 2
        freqs = torch.arange(half, dtype=torch.float32, device=labels.device) / half
        freqs = (1.0 / self.max_positions) ** freqs
        angles = labels.to(torch.float32)[:, None] * freqs[None, :]
        emb = torch.cat([angles.cos(), angles.sin()], dim=1)
        return emb.to(labels.dtype) if labels.is_floating_point() else emb


class SelfAttention(nn.Module):
    """GroupNorm -> multi-head self-attention over all H*W positions -> residual add."""

    def __init__(self, channels: int, num_heads: int, skip_scale: float):
        super().__init__()
        self.norm = _group_norm(channels)
        self.attn = nn.MultiheadAttention(channels, num_heads, batch_first=True)
        self.skip_scale = skip_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # (N, HW, C)
        out, _ = self.attn(tokens, tokens, tokens, need_weights=False)
        out = out.transpose(1, 2).reshape(n, c, h, w)
        return (x + out) * self.skip_scale


class ResBlock(nn.Module):
    """(GroupNorm -> SiLU -> Conv3x3) twice, plus the noise embedding, plus a skip path."""

    def __init__(self, in_channels: int, out_channels: int, emb_dim: int, skip_scale: float):
        super().__init__()
        self.norm0 = _group_norm(in_channels)
        self.conv0 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.affine = nn.Linear(emb_dim, out_channels)
        self.norm1 = _group_norm(out_channels)
        self.conv1 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.skip = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()
        self.skip_scale = skip_scale

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv0(F.silu(self.norm0(x)))
        h = h + self.affine(emb)[:, :, None, None]
        h = self.conv1(F.silu(self.norm1(h)))
        return (h + self.skip(x)) * self.skip_scale


class UNetBlock(nn.Module):
    """A residual block optionally followed by self-attention."""

    def __init__(self, in_channels: int, out_channels: int, cfg: SongUNetConfig, attention: bool):
        super().__init__()
        self.res = ResBlock(in_channels, out_channels, cfg.emb_dim, cfg.skip_scale)
        self.attn = SelfAttention(out_channels, cfg.num_heads, cfg.skip_scale) if attention else None
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = self.res(x, emb)
        return self.attn(x) if self.attn is not None else x


class Downsample(nn.Module):
    """Halve H and W: a stride-2 3x3 conv, or avg_pool2d(2)."""

    def __init__(self, channels: int, mode: str):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1) if mode == "conv" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) if self.conv is not None else F.avg_pool2d(x, 2)


class Upsample(nn.Module):
    """Double H and W: nearest-neighbour interpolation, then a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class SongUNet(nn.Module):
    """EDM-style U-Net: ``forward(x, noise_labels, condition=None) -> (N, out_channels, H, W)``.

    ``x`` is (N, in_channels, H, W), ``noise_labels`` a plain (N,) tensor (e.g. ``log(sigma) / 4``),
    ``condition`` (N, cond_channels, H, W) or None when ``cond_channels == 0``.
    """

    def __init__(self, config: SongUNetConfig | None = None, **overrides):
        super().__init__()
        self.config = cfg = dataclasses.replace(config or SongUNetConfig(), **overrides)
        mc, emb_dim = cfg.model_channels, cfg.emb_dim

        # Noise embedding: sinusoidal features, then an MLP.
        self.noise_embed = PositionalEmbedding(mc)
        self.embed_mlp = nn.Sequential(nn.Linear(mc, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim), nn.SiLU())

        # Encoder: every output is kept as a skip connection.
        self.input_conv = nn.Conv2d(cfg.in_channels + cfg.cond_channels, mc, 3, padding=1)
        self.encoder = nn.ModuleList()
        skip_channels = [mc]
        channels = mc
        for level, mult in enumerate(cfg.channel_mult):
            resolution = cfg.img_resolution >> level
            if level > 0:
                self.encoder.append(Downsample(channels, cfg.downsample))
                skip_channels.append(channels)
            for _ in range(cfg.num_blocks):
                block = UNetBlock(channels, mc * mult, cfg, attention=resolution in cfg.attn_resolutions)
                self.encoder.append(block)
                channels = block.out_channels
                skip_channels.append(channels)

        # Bottleneck at the coarsest resolution: attention between two residual blocks.
        self.middle = nn.ModuleList(
            [UNetBlock(channels, channels, cfg, attention=True), UNetBlock(channels, channels, cfg, attention=False)]
        )

        # Decoder: each block consumes one skip connection; upsampling between levels.
        self.decoder = nn.ModuleList()
        for level in reversed(range(len(cfg.channel_mult))):
            resolution = cfg.img_resolution >> level
            out = mc * cfg.channel_mult[level]
            for _ in range(cfg.num_blocks + 1):
                block = UNetBlock(channels + skip_channels.pop(), out, cfg, attention=resolution in cfg.attn_resolutions)
                self.decoder.append(block)
                channels = out
            if level > 0:
                self.decoder.append(Upsample(channels))
        assert not skip_channels

        self.out_norm = _group_norm(channels)
        self.out_conv = nn.Conv2d(channels, cfg.out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, noise_labels: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        if cfg.cond_channels:
            if condition is None:
                raise ValueError(f"this model expects a condition with {cfg.cond_channels} channels")
            x = torch.cat([x, condition], dim=1)
        elif condition is not None:
            raise ValueError("this model was built with cond_channels=0 but got a condition")

        emb = self.embed_mlp(self.noise_embed(noise_labels))  # (N, emb_dim), a plain tensor

        x = self.input_conv(x)
        skips = [x]
        for layer in self.encoder:
            x = layer(x, emb) if isinstance(layer, UNetBlock) else layer(x)
            skips.append(x)

        for block in self.middle:
            x = block(x, emb)

        for layer in self.decoder:
            if isinstance(layer, UNetBlock):
                x = layer(torch.cat([x, skips.pop()], dim=1), emb)
            else:
                x = layer(x)

        return self.out_conv(F.silu(self.out_norm(x)))

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of parameter elements (only those with ``requires_grad`` if ``trainable_only``)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
