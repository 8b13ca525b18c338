"""Plain-PyTorch architectures, installed as physics_dp.models; they never import sharding code."""

from .dit import DiT, DiTConfig
from .edm import EDMPrecond, edm_coefficients
from .factory import ARCHITECTURES, build_backbone, build_regression_unet, grid_multiple
from .padding import PadToMultiple
from .song_unet import SongUNet, SongUNetConfig
from .stormcast import StormCastUNet

__all__ = [
    "ARCHITECTURES",
    "DiT",
    "DiTConfig",
    "EDMPrecond",
    "PadToMultiple",
    "SongUNet",
    "SongUNetConfig",
    "StormCastUNet",
    "build_backbone",
    "build_regression_unet",
    "edm_coefficients",
    "grid_multiple",
]
