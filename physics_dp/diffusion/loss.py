"""EDM training loss (Karras et al. 2022, section 5 / Table 1) that gives the same value and
gradients sharded as on one device.

Every random number comes from :mod:`.noise` (a function of seed, sample index and global position),
and the mean is a true global mean: sums over a ShardTensor are global sums, so dividing the summed
weighted error by the global count of valid points needs no per-rank bookkeeping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..nn.losses import masked_mean
from .noise import randn_like_global, sample_sigma_lognormal

__all__ = ["EDMLoss"]

Denoiser = Callable[..., torch.Tensor]


def _per_sample(values: torch.Tensor, ndim: int) -> torch.Tensor:
    """(N,) -> (N, 1, ..., 1) to broadcast over a field of ``ndim`` dims."""
    return values.view(-1, *([1] * (ndim - 1)))


class EDMLoss:
    """``loss = mean over valid points of  w(sigma) * cw[c] * (D(y + sigma n; sigma) - y)^2``.

    ``sigma`` is log-normal per sample (``ln sigma ~ N(p_mean, p_std^2)``), ``n`` standard normal
    noise, ``w(sigma) = (sigma^2 + sigma_data^2) / (sigma * sigma_data)^2``.
    """

    def __init__(self, p_mean: float = -1.2, p_std: float = 1.2, sigma_data: float = 0.5):
        if not sigma_data > 0 or not math.isfinite(sigma_data):
            raise ValueError(f"sigma_data must be positive and finite, got {sigma_data}")
        if not p_std >= 0 or not math.isfinite(p_std) or not math.isfinite(p_mean):
            raise ValueError(f"p_mean must be finite and p_std finite and non-negative, got {p_mean}, {p_std}")
        self.p_mean = float(p_mean)
        self.p_std = float(p_std)
        self.sigma_data = float(sigma_data)

    def __call__(
        self,
        model: Denoiser,
        target: torch.Tensor,
        *,
        condition: torch.Tensor | None = None,
        seed: int,
        sample_ids: Sequence[int] | torch.Tensor,
        channel_weights: Sequence[float] | torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scalar loss (plain 0-d tensor) for a batch ``target`` (N, C, ...), plain or ShardTensor.

        ``model(x_noisy, sigma, condition)`` is an EDM denoiser (e.g. ``EDMPrecond``).
        ``sample_ids`` are the global indices of the N samples: they key sigma and the noise.
        ``channel_weights`` (C,) scale each channel's error; the mean still divides by the number of
        points.  ``mask`` (bool, laid out like ``target``) drops its False points from both sum and
        count; their target values must still be finite (the model sees them).  A batch with no
        valid point gives 0.
        """
        if target.ndim < 3:
            raise ValueError(f"target must be (N, C, *spatial), got shape {tuple(target.shape)}")
        sigma = sample_sigma_lognormal(
            seed, sample_ids, self.p_mean, self.p_std, dtype=target.dtype, device=target.device
        )
        noise = randn_like_global(target, seed, sample_ids)
        sigma_b = _per_sample(sigma, target.ndim)
        denoised = model(target + sigma_b * noise, sigma, condition)
        weight = _per_sample((sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2, target.ndim)
        error = weight * (denoised - target) ** 2
        if mask is not None and (mask.dtype != torch.bool or mask.shape != target.shape):
            raise ValueError(
                f"mask must be a bool tensor shaped like target {tuple(target.shape)}, "
                f"got {mask.dtype} of shape {tuple(mask.shape)}"
            )
        return masked_mean(error, mask, channel_weights)
