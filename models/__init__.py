"""Plain-PyTorch architectures, installed as physics_dp.models; they never import sharding code."""

from .song_unet import SongUNet, SongUNetConfig

__all__ = ["SongUNet", "SongUNetConfig"]
