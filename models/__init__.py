"""Plain-PyTorch architectures, installed as physics_dp.models; they never import sharding code."""

from .dit import DiT, DiTConfig
from .edm import EDMPrecond, edm_coefficients
from .song_unet import SongUNet, SongUNetConfig

__all__ = ["DiT", "DiTConfig", "EDMPrecond", "SongUNet", "SongUNetConfig", "edm_coefficients"]
