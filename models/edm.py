"""EDM preconditioning (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based
Generative Models", Table 1) around any backbone ``net(x, noise_labels, condition)``. Plain PyTorch.

    D(x; sigma) = c_skip(sigma) * x + c_out(sigma) * F(c_in(sigma) * x; c_noise(sigma), condition)

    c_skip  = sigma_data^2 / (sigma^2 + sigma_data^2)
    c_out   = sigma * sigma_data / sqrt(sigma^2 + sigma_data^2)
    c_in    = 1 / sqrt(sigma_data^2 + sigma^2)
    c_noise = log(sigma) / 4

``sigma`` is a plain (N,) tensor; the coefficients are computed on plain tensors and broadcast into
the field as ``c[:, None, None, None]``, so the wrapper runs unchanged on ``ShardTensor`` fields.
Losses are left to the training code.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["EDMPrecond", "edm_coefficients"]


def edm_coefficients(sigma: torch.Tensor, sigma_data: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(c_skip, c_out, c_in, c_noise)`` for a (N,) tensor of noise levels, each (N,)."""
    sd2 = sigma_data**2
    s2 = sigma * sigma
    c_skip = sd2 / (s2 + sd2)
    c_out = sigma * sigma_data / (s2 + sd2).sqrt()
    c_in = 1 / (sd2 + s2).sqrt()
    c_noise = sigma.log() / 4
    return c_skip, c_out, c_in, c_noise


class EDMPrecond(nn.Module):
    """``forward(x_noisy, sigma, condition=None)``: the denoised estimate D(x_noisy; sigma).

    ``x_noisy`` is (N, C, H, W) (a plain tensor or a ShardTensor), ``sigma`` a plain (N,) tensor of
    positive noise levels (a float or 0-d tensor is broadcast over the batch), ``condition`` is
    passed through to the backbone unchanged.
    """

    def __init__(self, net: nn.Module, sigma_data: float = 0.5):
        super().__init__()
        if not sigma_data > 0 or not math.isfinite(sigma_data):
            raise ValueError(f"sigma_data must be positive and finite, got {sigma_data}")
        self.net = net
        self.sigma_data = float(sigma_data)

    def forward(self, x_noisy: torch.Tensor, sigma: torch.Tensor | float, condition: torch.Tensor | None = None) -> torch.Tensor:
        n = x_noisy.shape[0]
        sigma = torch.as_tensor(sigma, dtype=x_noisy.dtype, device=x_noisy.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(n)
        if sigma.shape != (n,):
            raise ValueError(f"sigma must have shape ({n},) (one noise level per sample), got {tuple(sigma.shape)}")
        c_skip, c_out, c_in, c_noise = edm_coefficients(sigma, self.sigma_data)
        f_x = self.net(c_in[:, None, None, None] * x_noisy, c_noise, condition)
        return c_skip[:, None, None, None] * x_noisy + c_out[:, None, None, None] * f_x

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of parameter elements of the backbone (only trainable ones if ``trainable_only``)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
