"""Command-line options of ``python -m physics_dp.infer``: ``key=value`` tokens, typed.

Inference keys (:class:`InferConfig`) are checked against a schema, so a typo fails at start with
the list of valid keys. A dotted key naming a section of the training config (``sampling.num_steps=4``,
``data.valid_times=[40,48]``) overrides the run's saved ``config.yaml`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import TrainConfig

__all__ = ["InferConfig", "parse_args"]


@dataclass
class InferConfig:
    """What to forecast and where to put it."""

    run_dir: Optional[str] = None  # a training run directory (holds config.yaml and <stage>/model.pt)
    steps: int = 1  # lead steps to roll out (each of data.lead_time time steps)
    members: int = 1  # ensemble members (diffusion samples); 1 without a diffusion model
    start_time: int = 0  # index of the initial sample in the validation split
    out: Optional[str] = None  # output directory (default RUN_DIR/inference)
    seed: int = 0  # sampling seed; noise is keyed by (seed, lead step, member)
    domain_size: Optional[int] = None  # ranks splitting the grid (default: all); the rest split members
    figures: bool = True  # one PNG per lead step (member 0 vs truth)


_OWN = {f.name for f in fields(InferConfig)}
_SECTIONS = {f.name for f in fields(TrainConfig)}


def parse_args(argv: Sequence[str]) -> tuple[InferConfig, list[str]]:
    """Split ``key=value`` tokens into inference options and overrides of the run's config."""
    own: list[str] = []
    overrides: list[str] = []
    for token in argv:
        key, sep, _ = token.partition("=")
        if not sep or not key:
            raise ValueError(f"argument {token!r} is not key=value; e.g. run_dir=outputs/stormcast/... steps=4")
        if key in _OWN:
            own.append(token)
        elif key.split(".", 1)[0] in _SECTIONS and "." in key:
            overrides.append(token)
        else:
            raise ValueError(
                f"unknown option {key!r}; inference options are {sorted(_OWN)}, and dotted keys of the training "
                f"config sections {sorted(_SECTIONS)} (e.g. sampling.num_steps=8) override the run's config.yaml"
            )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(InferConfig), OmegaConf.from_dotlist(own))
    except OmegaConfBaseException as error:
        raise ValueError(f"bad inference option: {error}") from None
    options: InferConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    check(options)
    return options, overrides


def check(options: InferConfig) -> None:
    """Value checks shared by the CLI and in-process callers."""
    if not options.run_dir:
        raise ValueError("run_dir=PATH is required: the directory a training run wrote (with config.yaml)")
    for key in ("steps", "members"):
        if getattr(options, key) < 1:
            raise ValueError(f"{key}={getattr(options, key)} must be at least 1")
    if options.start_time < 0:
        raise ValueError(f"start_time={options.start_time} must be a non-negative index into the validation split")
    if options.domain_size is not None and options.domain_size < 1:
        raise ValueError(f"domain_size={options.domain_size} must be at least 1")
