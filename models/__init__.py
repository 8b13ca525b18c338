"""Plain-PyTorch architectures, installed as physics_dp.models; they never import sharding code."""
