"""The shipped model sizes (configs/model/*.yaml) build, and their parameter counts are as documented."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from physics_dp.models import EDMPrecond, build_backbone, build_regression_unet

# (state, background, invariant) channels and grid used to count parameters of each size.
PAPER_CHANNELS, PAPER_GRID = (99, 26, 2), (512, 640)
SMALL_CHANNELS, SMALL_GRID = (3, 3, 2), (64, 96)
# Parameter counts (regression U-Net, diffusion U-Net, diffusion DiT), as listed in docs/models.md.
EXPECTED = {
    "test": (42_259, 42_691, 36_476),
    "lite": (1_541_923, 1_543_651, 1_931_184),
    "paper": (58_879_203, 106_252_899, 154_289_088),
}


def _config(size: str) -> dict:
    return yaml.safe_load(resources.files("physics_dp.configs").joinpath(f"model/{size}.yaml").read_text())


def _counts(size: str) -> tuple[int, int, int]:
    cfg = _config(size)
    (state, background, invariants), grid = (PAPER_CHANNELS, PAPER_GRID) if size == "paper" else (SMALL_CHANNELS, SMALL_GRID)
    regression = build_regression_unet(
        grid_shape=grid, in_channels=state, out_channels=state, cond_channels=background + invariants, options=cfg["regression"]
    )
    # StormCast's diffusion stage sees the state, the regression mean, the background and the invariants.
    cond = 2 * state + background + invariants
    diffusion = {
        arch: EDMPrecond(
            build_backbone(arch, grid_shape=grid, in_channels=state, out_channels=state, cond_channels=cond, options=cfg["diffusion"][arch]),
            sigma_data=cfg["diffusion"]["sigma_data"],
        )
        for arch in ("unet", "dit")
    }
    return regression.num_parameters(), diffusion["unet"].num_parameters(), diffusion["dit"].num_parameters()


@pytest.mark.parametrize("size", list(EXPECTED))
def test_parameter_counts(size):
    assert _counts(size) == EXPECTED[size]


def test_paper_sizes_match_stormcast():
    """The StormCast paper: regression U-Net about 60M parameters, diffusion U-Net about 100M."""
    regression, diffusion, _ = EXPECTED["paper"]
    assert 55e6 < regression < 65e6
    assert 95e6 < diffusion < 110e6


def test_unknown_architecture():
    with pytest.raises(ValueError, match="unknown architecture 'cnn'"):
        build_backbone("cnn", grid_shape=(8, 8), in_channels=1, out_channels=1)
