"""``F.lp_pool*d`` and ``F.local_response_norm`` on sharded tensors equal one device, forward and
backward (both raised in backward: torch's composites called the pools with torch functions off)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.nn as nn
import torch.nn.functional as F

from physics_dp.testing import run_on_ranks

from .test_shape_ops import LAYOUTS, check_family, world_of

FAMILY: dict[str, Callable] = {
    "lp_pool2d(2, 2)": lambda x: F.lp_pool2d(x.abs() + 0.1, 2, 2),
    "lp_pool2d(3, (2, 1), stride 1)": lambda x: F.lp_pool2d(x.abs() + 0.1, 3, (2, 1), stride=1),
    "lp_pool2d(inf, 2)": lambda x: F.lp_pool2d(x, float("inf"), 2),
    "nn.LPPool1d over W": lambda x: nn.LPPool1d(2, 2)(x.flatten(0, 1).abs() + 0.1),
    "lp_pool3d over (C, H, W)": lambda x: F.lp_pool3d(x.abs().unsqueeze(1) + 0.1, 2, (1, 2, 2)),
    "local_response_norm(2)": lambda x: F.local_response_norm(x, 2),
    "nn.LocalResponseNorm(3) on (N, C, H, W, 1)": lambda x: nn.LocalResponseNorm(3, alpha=0.1)(x.unsqueeze(-1)),
    "local_response_norm on (N, C, H * W)": lambda x: F.local_response_norm(x.flatten(2), 3),
}


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pool_composites_match_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)

