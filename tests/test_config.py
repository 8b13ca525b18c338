"""The Hydra config: every shipped group composes into the typed schema, and mistakes fail early."""

from __future__ import annotations

from importlib import resources

import pytest
from omegaconf import OmegaConf

from physics_dp.config import TrainConfig, compose_config, validate


def _group_options(group: str) -> list[str]:
    folder = resources.files("physics_dp.configs").joinpath(group)
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


@pytest.mark.parametrize(
    "group", ["model", "data", "parallel", "optim", "schedule", "training", "logging", "experiment"]
)
def test_every_shipped_option_composes_and_validates(group):
    options = _group_options(group)
    assert options, group
    for option in options:
        override = f"+experiment={option}" if group == "experiment" else f"{group}={option}"
        cfg = compose_config([override])
        if cfg.data.source == "netcdf":  # the template leaves the files to the user
            with pytest.raises(ValueError, match="data.state_files"):
                validate(cfg)
        else:
            validate(cfg)
        assert OmegaConf.get_type(cfg) is TrainConfig


def test_experiments_set_what_they_say():
    cfg = compose_config(["+experiment=stormcast", "parallel.domain_size=2"])
    assert (cfg.task, cfg.training.stage, cfg.parallel.domain_size) == ("stormcast", "both", 2)
    cfg = compose_config(["+experiment=diffusion", "model.diffusion.architecture=dit"])
    assert (cfg.task, cfg.model.diffusion.architecture) == ("diffusion", "dit")


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.max_stpes=3", "max_stpes"),
        ("training.max_steps=many", "max_steps"),
        ("model.regression.channel_mult=wide", "channel_mult"),
    ],
)
def test_mistyped_keys_and_wrong_types_fail_at_composition(override, message):
    with pytest.raises(Exception, match=message):
        compose_config([override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.precision=fp16", "training.precision='fp16' is not one of"),
        ("parallel.data_parallel=zero", "parallel.data_parallel='zero' is not one of"),
        ("training.max_steps=0", "training.max_steps must be a positive integer"),
        ("data.train_times=[5,2]", "data.train_times must be [start, stop)"),
        ("logging.wandb_mode=cloud", "logging.wandb_mode='cloud'"),
        ("+training.max_stpes=3", "unknown config key(s) ['training.max_stpes']"),
        ("sampling.num_steps=0", "sampling.num_steps must be a positive integer, got 0"),
        ("optim.lr=-1", "optim.lr=-1.0 is invalid: it must be a finite number > 0"),
        ("optim.lr=nan", "optim.lr=nan is invalid"),
        ("optim.betas=[0.9,1.5]", "optim.betas=[0.9, 1.5] is invalid: it must be two numbers in [0, 1)"),
        ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 is invalid"),
        ("schedule.min_lr_ratio=2", "schedule.min_lr_ratio=2.0 is invalid"),
        ("training.grad_clip=0", "training.grad_clip=0.0 is invalid: it must be null or a finite number > 0"),
        ("sampling.sigma_min=100", "sampling.sigma_max=80.0 is invalid: it must be greater than sampling.sigma_min=100.0"),
        ("parallel.timeout_s=0", "parallel.timeout_s=0.0 is invalid"),
        ("model.regression.channel_mult=[]", "model.regression.channel_mult=[] is invalid"),
        ("model.diffusion.dit.depth=0", "model.diffusion.dit.depth must be a positive integer"),
        ("data.prefetch=-1", "data.prefetch=-1 is invalid"),
        ("parallel.fsdp_unit_params=-1", "parallel.fsdp_unit_params=-1 is invalid"),
        ("data.valid_times=[-2,4]", "data.valid_times must be [start, stop)"),
        ("training.channel_weights=[0,0]", "training.channel_weights=[0.0, 0.0] is invalid"),
        ("run.name=a/b", "run.name='a/b' must be a non-empty name"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        validate(compose_config([override]))


def test_file_keys_take_a_path_a_glob_or_a_list(tmp_path):
    from physics_dp.training.data_setup import data_spec

    files = [str(tmp_path / "a.nc"), str(tmp_path / "b.nc")]
    cfg = compose_config(["data=netcdf", f"data.state_files=[{files[0]},{files[1]}]", "data.state_variables=[t]",
                          f"data.background_files={tmp_path}/bg_*.nc", "data.background_variables=[t]"])
    validate(cfg)
    spec = data_spec(cfg.data)
    assert spec.state_files == files and spec.background_files == f"{tmp_path}/bg_*.nc"
    cfg.data.state_files = [1, 2]
    with pytest.raises(ValueError, match=r"data.state_files must be a path, a glob or a list of them"):
        validate(cfg)
