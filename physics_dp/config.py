"""Structured-config schema of ``python -m physics_dp.train`` (Hydra + OmegaConf dataclasses).

The schema is registered as the first entry of the defaults list in ``configs/train.yaml``, so
every YAML file and every command-line override is merged into typed dataclasses: a mistyped key
or a value of the wrong type fails at start with a message naming it, on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

__all__ = [
    "DataConfig",
    "DiTOptions",
    "DiffusionModelConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "SamplingConfig",
    "ScheduleConfig",
    "SyntheticDataConfig",
    "TrainConfig",
    "TrainingConfig",
    "UNetOptions",
    "compose_config",
    "register_schema",
    "validate",
]


@dataclass
class UNetOptions:
    """SongUNet hyper-parameters (channel counts and grid size come from the data)."""

    model_channels: int = 8
    channel_mult: list[int] = field(default_factory=lambda: [1, 2])
    num_blocks: int = 1
    attn_resolutions: list[int] = field(default_factory=list)
    num_heads: int = 1
    downsample: str = "conv"
    embedding_dim: Optional[int] = None


@dataclass
class DiTOptions:
    patch_size: int = 2
    hidden_size: int = 16
    depth: int = 2
    num_heads: int = 2
    mlp_ratio: float = 4.0
    frequency_embedding_size: int = 16


@dataclass
class DiffusionModelConfig:
    architecture: str = "unet"  # unet | dit
    sigma_data: float = 0.5
    conditional: bool = True  # diffusion recipe: condition on background + invariants (false: unconditional)
    unet: UNetOptions = field(default_factory=UNetOptions)
    dit: DiTOptions = field(default_factory=DiTOptions)


@dataclass
class ModelConfig:
    size: str = "test"
    regression: UNetOptions = field(default_factory=UNetOptions)
    diffusion: DiffusionModelConfig = field(default_factory=DiffusionModelConfig)


@dataclass
class SyntheticDataConfig:
    """The built-in dataset written once into ``DataConfig.root`` when no files are named."""

    n_times: int = 48
    height: int = 64
    width: int = 96
    seed: int = 0


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | netcdf
    root: Optional[str] = None  # synthetic cache directory (default: ~/.cache/physics_dp/synthetic-...)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    # A path, a glob, or a list of either (netcdf source); Any because OmegaConf has no str | list type.
    state_files: Any = None
    state_variables: list[str] = field(default_factory=list)
    background_files: Any = None  # like state_files
    background_variables: list[str] = field(default_factory=list)
    invariant_file: Optional[str] = None
    invariant_variables: list[str] = field(default_factory=list)
    level: Optional[int] = None
    lead_time: int = 1
    train_times: Optional[list[int]] = None  # [start, stop) time indices
    valid_times: Optional[list[int]] = None
    stats_file: Optional[str] = None
    prefetch: int = 2


@dataclass
class ParallelConfig:
    domain_size: int = 1  # ranks that split each sample's grid (rows); data size = world / domain_size
    data_parallel: str = "fsdp"  # fsdp | ddp | none
    fsdp_unit_params: int = 1 << 24  # a block this large is its own FSDP unit; smaller ones stay in the root unit
    timeout_s: float = 300.0  # a collective or a silent rank waited on longer than this ends every rank


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adam | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    fused: bool = True  # one fused kernel per step, not torch's ops per parameter tensor (docs/performance.md)


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # constant | cosine | linear
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1


@dataclass
class TrainingConfig:
    stage: str = "regression"  # stormcast: regression | diffusion | both
    max_steps: int = 100
    global_batch_size: int = 2
    grad_accumulation: int = 1
    grad_clip: Optional[float] = 1.0
    precision: str = "fp32"  # fp32 | bf16
    compile: bool = False  # torch.compile the model (training steps, validation and inference)
    compile_backend: str = "inductor"  # inductor | aot_eager | eager (torch.compile backends)
    channels_last: bool = False  # the batches (so the activations) channels last; parameters stay as built: see docs/performance.md
    seed: int = 0
    keep_freed_memory: bool = True  # keep freed host memory for the next step (no page refaults; see host_memory.py)
    checkpoint_interval: int = 50
    validation_interval: int = 50
    validation_batches: int = 2
    log_interval: int = 10
    keep_checkpoints: int = 3
    resume: bool = True  # continue from the run directory's latest checkpoint if there is one
    regression_weights: Optional[str] = None  # stormcast diffusion stage: exported regression model (.pt)
    channel_weights: Optional[list[float]] = None  # per state channel loss weights


@dataclass
class SamplingConfig:
    """EDM sampling for validation figures and inference."""

    num_steps: int = 18
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0
    s_churn: float = 0.0
    num_samples: int = 1


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # disabled | offline | online
    project: str = "physics_dp"
    tags: list[str] = field(default_factory=list)
    figures: bool = True


@dataclass
class RunConfig:
    name: str = "run"
    dir: Optional[str] = None  # default: <output_root>/<name>/<timestamp>; name a fixed dir to resume
    output_root: str = "outputs"
    overwrite: bool = False  # start over in a run.dir that already holds a run (its results are deleted)


@dataclass
class TrainConfig:
    task: str = "stormcast"  # stormcast | diffusion
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "task": ("stormcast", "diffusion"),
    "model.diffusion.architecture": ("unet", "dit"),
    "data.source": ("synthetic", "netcdf"),
    "parallel.data_parallel": ("fsdp", "ddp", "none"),
    "optim.name": ("adamw", "adam", "sgd"),
    "schedule.name": ("constant", "cosine", "linear"),
    "training.stage": ("regression", "diffusion", "both"),
    "training.precision": ("fp32", "bf16"),
    "training.compile_backend": ("inductor", "aot_eager", "eager"),
    "logging.wandb_mode": ("disabled", "offline", "online"),
}
_POSITIVE_INTS = (
    "parallel.domain_size",
    "training.max_steps",
    "training.global_batch_size",
    "training.grad_accumulation",
    "training.checkpoint_interval",
    "training.validation_interval",
    "training.log_interval",
    "training.keep_checkpoints",
    "data.lead_time",
    "data.synthetic.n_times",
    "data.synthetic.height",
    "data.synthetic.width",
    "sampling.num_steps",
    "sampling.num_samples",
    "model.regression.model_channels",
    "model.regression.num_blocks",
    "model.regression.num_heads",
    "model.diffusion.unet.model_channels",
    "model.diffusion.unet.num_blocks",
    "model.diffusion.unet.num_heads",
    "model.diffusion.dit.patch_size",
    "model.diffusion.dit.hidden_size",
    "model.diffusion.dit.depth",
    "model.diffusion.dit.num_heads",
    "model.diffusion.dit.frequency_embedding_size",
)
_POSITIVE_NUMBERS = (
    "parallel.timeout_s",
    "optim.lr",
    "optim.eps",
    "model.diffusion.sigma_data",
    "model.diffusion.dit.mlp_ratio",
    "sampling.sigma_min",
    "sampling.sigma_max",
    "sampling.rho",
)
_NON_NEGATIVE = (
    "optim.weight_decay",
    "optim.momentum",
    "schedule.warmup_steps",
    "training.validation_batches",
    "training.seed",
    "sampling.s_churn",
    "data.prefetch",
    "data.synthetic.seed",
    "parallel.fsdp_unit_params",
)
_OPTIONAL_POSITIVE = ("training.grad_clip", "model.diffusion.unet.embedding_dim", "model.regression.embedding_dim")
_POSITIVE_LISTS = (
    "model.regression.channel_mult",
    "model.diffusion.unet.channel_mult",
    "model.regression.attn_resolutions",
    "model.diffusion.unet.attn_resolutions",
)


def register_schema() -> None:
    """Make ``schema`` (the :class:`TrainConfig` dataclass) available to the defaults list."""
    ConfigStore.instance().store(name="schema", node=TrainConfig)


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config ``python -m physics_dp.train OVERRIDES...`` would run with (for tests, notebooks)."""
    from hydra import compose, initialize_config_module

    register_schema()
    with initialize_config_module("physics_dp.configs", version_base=None):
        return compose("train", overrides=list(overrides))


def _unknown_keys(cfg: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    """Keys of ``cfg`` the schema does not have (``+key=...`` overrides can add them past the schema)."""
    unknown = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if key not in schema:
            unknown.append(path)
        elif isinstance(schema[key], DictConfig) and isinstance(cfg[key], DictConfig):
            unknown += _unknown_keys(cfg[key], schema[key], path + ".")
    return unknown


def validate(cfg: DictConfig | Any) -> None:
    """Checks the type system cannot express; raise ValueError naming the key and the choices."""
    unknown = _unknown_keys(cfg, OmegaConf.structured(TrainConfig))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}: check the spelling (see physics_dp/config.py for the schema)")
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ValueError(f"config key {key}={value!r} is not one of {list(choices)}")
    _check_numbers(cfg)
    for key in ("data.state_files", "data.background_files"):
        value = OmegaConf.select(cfg, key)
        if value is not None and not isinstance(value, str) and not (
            OmegaConf.is_list(value) and all(isinstance(item, str) for item in value)
        ):
            raise ValueError(f"config key {key} must be a path, a glob or a list of them, got {value!r}")
    if cfg.data.source == "netcdf" and (not cfg.data.state_files or not cfg.data.state_variables):
        raise ValueError("data.source=netcdf needs data.state_files (a path, glob or list of them) and data.state_variables")
    for key in ("data.train_times", "data.valid_times"):
        value = OmegaConf.select(cfg, key)
        if value is not None and (len(value) != 2 or value[0] < 0 or value[0] >= value[1]):
            raise ValueError(f"config key {key} must be [start, stop) with 0 <= start < stop, got {list(value)}")
    if not str(cfg.run.name).strip() or "/" in str(cfg.run.name):
        raise ValueError(f"config key run.name={cfg.run.name!r} must be a non-empty name without '/'; use run.dir for a path")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_numbers(cfg: DictConfig | Any) -> None:
    """Ranges of every numeric key, each error naming the key, the value and what is allowed."""

    def fail(key: str, value: Any, allowed: str) -> None:
        raise ValueError(f"config key {key}={value!r} is invalid: it must be {allowed}")

    for key in _POSITIVE_INTS:
        value = OmegaConf.select(cfg, key)
        if value is None or value < 1:
            raise ValueError(f"config key {key} must be a positive integer, got {value!r}")
    for key in _POSITIVE_NUMBERS:
        value = OmegaConf.select(cfg, key)
        if not _number(value) or value <= 0:
            fail(key, value, "a finite number > 0")
    for key in _NON_NEGATIVE:
        value = OmegaConf.select(cfg, key)
        if not _number(value) or value < 0:
            fail(key, value, "a finite number >= 0")
    for key in _OPTIONAL_POSITIVE:
        value = OmegaConf.select(cfg, key)
        if value is not None and (not _number(value) or value <= 0):
            fail(key, value, "null or a finite number > 0")
    for key in _POSITIVE_LISTS:
        value = list(OmegaConf.select(cfg, key))
        if any(v < 1 for v in value) or (key.endswith("channel_mult") and not value):
            fail(key, value, "a list of positive integers" + (" (at least one level)" if key.endswith("channel_mult") else ""))
    betas = list(cfg.optim.betas)
    if len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
        fail("optim.betas", betas, "two numbers in [0, 1)")
    if not 0 <= cfg.schedule.min_lr_ratio <= 1:
        fail("schedule.min_lr_ratio", cfg.schedule.min_lr_ratio, "in [0, 1]")
    if cfg.sampling.sigma_max <= cfg.sampling.sigma_min:
        fail("sampling.sigma_max", cfg.sampling.sigma_max, f"greater than sampling.sigma_min={cfg.sampling.sigma_min}")
    weights = cfg.training.channel_weights
    if weights is not None and (not weights or not all(_number(w) and w >= 0 for w in weights)
                                or not any(w > 0 for w in weights)):
        fail("training.channel_weights", list(weights), "null or a list of finite numbers >= 0, at least one > 0")
