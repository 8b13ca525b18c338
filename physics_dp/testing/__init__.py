"""Helpers for testing distributed code: a persistent multi-process rank pool and sharded-vs-single checks."""

from .compare import MatchReport, assert_sharded_matches
from .rank_pool import RankFailure, free_port, get_mesh, run_on_ranks, shutdown_pools
from .gpu_paths import collectives_over_c10d, sharded_code_on_size_one_axes
from .traffic import forward_backward_traffic

__all__ = [
    "MatchReport",
    "RankFailure",
    "assert_sharded_matches",
    "collectives_over_c10d",
    "forward_backward_traffic",
    "free_port",
    "get_mesh",
    "run_on_ranks",
    "sharded_code_on_size_one_axes",
    "shutdown_pools",
]
