"""Deterministic and stochastic EDM samplers (Karras et al. 2022, Algorithm 2: Heun steps with
optional "churn"), identical sharded and on one device.

The churn noise of step ``i`` and the initial latents come from :mod:`.noise`, keyed by
``(seed, step)`` and each sample's global index, so any split draws the single-device numbers; the
rest are pointwise updates, which ShardTensor runs on each slab.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .noise import derive_seed, randn_like_global

__all__ = ["edm_sampler", "edm_sigma_steps"]

Denoiser = Callable[..., torch.Tensor]


def edm_sigma_steps(num_steps: int, sigma_min: float, sigma_max: float, rho: float) -> list[float]:
    """The ``num_steps`` noise levels ``t_0 = sigma_max > ... > t_{N-1} = sigma_min``, then ``t_N = 0``.

    ``t_i = (sigma_max^(1/rho) + i / (N - 1) * (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    if not 0 < sigma_min < sigma_max or not math.isfinite(sigma_max):
        raise ValueError(f"need 0 < sigma_min < sigma_max < inf, got sigma_min={sigma_min}, sigma_max={sigma_max}")
    if not rho > 0:
        raise ValueError(f"rho must be positive, got {rho}")
    if num_steps == 1:
        return [float(sigma_max), 0.0]
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    steps = [(hi + i / (num_steps - 1) * (lo - hi)) ** rho for i in range(num_steps)]
    return steps + [0.0]


def _call(model: Denoiser, x: torch.Tensor, sigma: float, condition: torch.Tensor | None) -> torch.Tensor:
    levels = torch.full((x.shape[0],), sigma, dtype=x.dtype, device=x.device)
    return model(x, levels, condition)


@torch.no_grad()
def edm_sampler(
    model: Denoiser,
    latents_like: torch.Tensor,
    *,
    condition: torch.Tensor | None = None,
    seed: int,
    sample_ids: Sequence[int] | torch.Tensor,
    num_steps: int = 18,
    sigma_min: float = 0.002,
    sigma_max: float = 80.0,
    rho: float = 7.0,
    s_churn: float = 0.0,
    s_min: float = 0.0,
    s_max: float = float("inf"),
    s_noise: float = 1.0,
) -> torch.Tensor:
    """Samples shaped and laid out like ``latents_like`` (its values are unused).

    ``model(x, sigma, condition)`` is an EDM denoiser D(x; sigma) with ``sigma`` a (N,) tensor.
    Deterministic given ``seed`` and ``sample_ids``; ``s_churn = 0`` gives the ODE (Heun) sampler,
    ``s_churn > 0`` adds noise ``gamma_i = min(s_churn / num_steps, sqrt(2) - 1)`` at levels in
    ``[s_min, s_max]``.
    """
    sigmas = edm_sigma_steps(num_steps, sigma_min, sigma_max, rho)
    gamma_churn = min(s_churn / num_steps, math.sqrt(2.0) - 1.0) if s_churn > 0 else 0.0
    x = randn_like_global(latents_like, derive_seed(seed, 0), sample_ids) * sigmas[0]
    for i, (t_cur, t_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        gamma = gamma_churn if s_min <= t_cur <= s_max else 0.0
        t_hat = t_cur * (1.0 + gamma)
        if gamma > 0:
            eps = randn_like_global(x, derive_seed(seed, i + 1), sample_ids)
            x = x + (math.sqrt(t_hat**2 - t_cur**2) * s_noise) * eps
        slope = (x - _call(model, x, t_hat, condition)) / t_hat
        x_next = x + (t_next - t_hat) * slope
        if t_next > 0:
            slope_next = (x_next - _call(model, x_next, t_next, condition)) / t_next
            x_next = x + (t_next - t_hat) * (0.5 * slope + 0.5 * slope_next)
        x = x_next
    return x
