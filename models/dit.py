"""DiT (Peebles & Xie 2023, "Scalable Diffusion Models with Transformers") for 2-D fields (N, C, H, W).

Patchify with a Conv2d (kernel = stride = patch), add a learned position embedding, run
transformer blocks with adaLN-Zero conditioning on a noise embedding, then a modulated final
layer and unpatchify back to (N, out_channels, H, W). Plain PyTorch.

The model knows nothing about sharding: it uses only ordinary torch ops, so it runs unchanged
on ``ShardTensor`` inputs split over H and/or W. Conventions that keep it shard-friendly:

- a patch map becomes tokens with ``x.flatten(2).transpose(1, 2)`` ((N, D, H/p, W/p) ->
  (N, L, D), L = (H/p)(W/p), row-major over the patch grid) and tokens go back to a map with
  ``reshape(N, H/p, W/p, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(N, C, H, W)``;
- the noise embedding lives on plain (N, D) tensors; modulation is broadcast over tokens as
  ``x * (1 + scale[:, None]) + shift[:, None]``;
- attention is global: ``F.scaled_dot_product_attention`` on (N, heads, L, D / heads).

The position embedding is a learned parameter of shape (1, L, D) sized for the configured grid
``input_size = (H, W)``; inputs must have exactly that H and W (H and W may differ). It is
initialised with the fixed 2-D sin-cos embedding of the (H/p, W/p) patch grid (row index and
column index each fill half of the D channels), as in DiT.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DiT", "DiTConfig"]


@dataclass(frozen=True)
class DiTConfig:
    """Hyper-parameters of :class:`DiT`."""

    input_size: tuple[int, int] = (64, 64)  # (H, W) of the field; both divisible by patch_size
    patch_size: int = 2
    in_channels: int = 1
    out_channels: int = 1
    cond_channels: int = 0  # extra input channels concatenated to x
    hidden_size: int = 384  # token width D
    depth: int = 12
    num_heads: int = 6
    mlp_ratio: float = 4.0
    frequency_embedding_size: int = 256  # sinusoidal features of the noise labels

    def __post_init__(self) -> None:
        if isinstance(self.input_size, int):  # allow a square grid given as one int
            object.__setattr__(self, "input_size", (self.input_size, self.input_size))
        object.__setattr__(self, "input_size", tuple(self.input_size))
        if len(self.input_size) != 2:
            raise ValueError(f"input_size must be (H, W), got {self.input_size!r}")
        for name, size in zip(("H", "W"), self.input_size):
            if size % self.patch_size:
                raise ValueError(f"input {name}={size} is not divisible by patch_size={self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_size % 4:
            raise ValueError(f"hidden_size must be divisible by 4 (2-D sin-cos init), got {self.hidden_size}")
        if self.frequency_embedding_size % 2:
            raise ValueError(f"frequency_embedding_size must be even, got {self.frequency_embedding_size}")

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patch grid (H / p, W / p)."""
        return self.input_size[0] // self.patch_size, self.input_size[1] // self.patch_size

    @property
    def num_tokens(self) -> int:
        gh, gw = self.grid_size
        return gh * gw


def sincos_pos_embed_2d(dim: int, grid_h: int, grid_w: int) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding (grid_h * grid_w, dim), row-major like ``flatten(2)``.

    The first dim/2 channels encode the row index, the last dim/2 the column index, each as
    [sin, cos] of dim/4 frequencies. Correct for non-square grids.
    """
    if dim % 4:
        raise ValueError(f"dim must be divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)

    def one_axis(pos: torch.Tensor) -> torch.Tensor:
        angles = pos[:, None] * omega[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=1)  # (len, dim / 2)

    rows = one_axis(torch.arange(grid_h, dtype=torch.float64))  # (gh, dim / 2)
    cols = one_axis(torch.arange(grid_w, dtype=torch.float64))  # (gw, dim / 2)
    emb = torch.cat(
        [rows[:, None, :].expand(grid_h, grid_w, -1), cols[None, :, :].expand(grid_h, grid_w, -1)], dim=2
    )
    return emb.reshape(grid_h * grid_w, dim).float()


class NoiseEmbedding(nn.Module):
    """Sinusoidal features of a plain (N,) tensor of noise labels, then an MLP: (N,) -> (N, D)."""

    def __init__(self, hidden_size: int, frequency_size: int = 256, max_period: float = 10000.0):
        super().__init__()
        self.frequency_size = frequency_size
        self.max_period = max_period
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        half = self.frequency_size // 2
        freqs = torch.exp(-math.log(self.max_period) * torch.arange(half, dtype=torch.float32, device=labels.device) / half)
        angles = labels.to(torch.float32)[:, None] * freqs[None, :]
        emb = torch.cat([angles.cos(), angles.sin()], dim=1)
        dtype = self.mlp[0].weight.dtype
        return self.mlp(emb.to(dtype))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Tokens (N, L, D), plain (N, D) shift and scale."""
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head self-attention over all L tokens with F.scaled_dot_product_attention."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        heads = self.num_heads
        qkv = self.qkv(x).view(n, length, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)  # (3, N, h, L, hd)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # (N, h, L, hd)
        return self.proj(out.transpose(1, 2).reshape(n, length, dim))


class DiTBlock(nn.Module):
    """Pre-norm attention and MLP, each with adaLN-Zero shift / scale / gate from the embedding."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa[:, None] * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp[:, None] * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm, then a Linear to p * p * out_channels per token."""

    def __init__(self, dim: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Diffusion transformer: ``forward(x, noise_labels, condition=None) -> (N, out_channels, H, W)``.

    ``x`` is (N, in_channels, H, W) with (H, W) == ``config.input_size``, ``noise_labels`` a plain
    (N,) tensor (e.g. ``log(sigma) / 4``), ``condition`` (N, cond_channels, H, W) or None when
    ``cond_channels == 0``.

    Initialisation follows DiT: Xavier-uniform linears, zero adaLN modulation and zero final
    linear (adaLN-Zero), so a freshly built model outputs zeros.
    """

    def __init__(self, config: DiTConfig | None = None, **overrides):
        super().__init__()
        self.config = cfg = dataclasses.replace(config or DiTConfig(), **overrides)
        dim, p = cfg.hidden_size, cfg.patch_size

        self.x_embedder = nn.Conv2d(cfg.in_channels + cfg.cond_channels, dim, kernel_size=p, stride=p)
        self.t_embedder = NoiseEmbedding(dim, cfg.frequency_embedding_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_tokens, dim))
        self.blocks = nn.ModuleList([DiTBlock(dim, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(dim, p, cfg.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        with torch.no_grad():
            self.pos_embed.copy_(sincos_pos_embed_2d(self.config.hidden_size, *self.config.grid_size)[None])
        w = self.x_embedder.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.bias)
        for layer in (self.t_embedder.mlp[0], self.t_embedder.mlp[2]):
            nn.init.normal_(layer.weight, std=0.02)
        for block in [*self.blocks, self.final_layer]:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """(N, L, p * p * C) -> (N, C, H, W)."""
        p, c = self.config.patch_size, self.config.out_channels
        n = tokens.shape[0]
        x = tokens.reshape(n, height // p, width // p, p, p, c)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(n, c, height, width)

    def forward(self, x: torch.Tensor, noise_labels: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        if cfg.cond_channels:
            if condition is None:
                raise ValueError(f"this model expects a condition with {cfg.cond_channels} channels")
            x = torch.cat([x, condition], dim=1)
        elif condition is not None:
            raise ValueError("this model was built with cond_channels=0 but got a condition")
        height, width = x.shape[-2:]
        if (height, width) != cfg.input_size:
            raise ValueError(f"input size {(height, width)} != configured input_size {cfg.input_size}")

        c = self.t_embedder(noise_labels)  # (N, D), a plain tensor
        tokens = self.x_embedder(x).flatten(2).transpose(1, 2)  # (N, L, D)
        tokens = tokens + self.pos_embed
        for block in self.blocks:
            tokens = block(tokens, c)
        tokens = self.final_layer(tokens, c)  # (N, L, p * p * out_channels)
        return self.unpatchify(tokens, height, width)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of parameter elements (only those with ``requires_grad`` if ``trainable_only``)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
