"""Helpers for testing distributed code: a persistent multi-process rank pool and sharded-vs-single checks."""

from .compare import MatchReport, assert_sharded_matches
from .rank_pool import RankFailure, get_mesh, run_on_ranks, shutdown_pools

__all__ = ["MatchReport", "RankFailure", "assert_sharded_matches", "get_mesh", "run_on_ranks", "shutdown_pools"]
