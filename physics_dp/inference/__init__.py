"""Forecasts from a trained run: StormCast rollouts and diffusion ensembles, domain parallel.

The entry point is ``python -m physics_dp.infer`` (:mod:`physics_dp.infer`); this package holds its
pieces: options, reloading a run, the forecast loop, scores and output metadata.
"""

from .loading import Predictor, load_predictor, load_run_config
from .options import InferConfig, parse_args
from .rollout import LeadStep, Rollout
from .scores import ScoreTable, score_step
from .sources import SourceInfo, describe_sources

__all__ = [
    "InferConfig",
    "LeadStep",
    "Predictor",
    "Rollout",
    "ScoreTable",
    "SourceInfo",
    "describe_sources",
    "load_predictor",
    "load_run_config",
    "parse_args",
    "score_step",
]
