"""Diffusion training and sampling (EDM) whose randomness, losses and samples do not depend on the layout."""

from .loss import EDMLoss
from .noise import derive_seed, randn_like_global, sample_sigma_lognormal
from .sampler import edm_sampler, edm_sigma_steps

__all__ = ["EDMLoss", "derive_seed", "edm_sampler", "edm_sigma_steps", "randn_like_global", "sample_sigma_lognormal"]
