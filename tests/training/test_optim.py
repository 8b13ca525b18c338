"""The optimizers the config names: fused by default, with the per-tensor loop's results."""

from __future__ import annotations

import pytest
import torch

from physics_dp.config import compose_config
from physics_dp.training.optim import build_optimizer


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(8, 4, 3, 3), (8,), (5, 8)]]


def _steps(overrides: list[str], steps: int = 3) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    params = _params()
    optimizer = build_optimizer(compose_config(["+experiment=stormcast", *overrides]).optim, params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return optimizer, [p.detach() for p in params]


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_fused_by_default_and_equal_to_the_loop(name):
    extra = ["optim=sgd"] if name == "sgd" else [f"optim.name={name}", "optim.weight_decay=0.01"]
    fused, fused_params = _steps(extra)
    loop, loop_params = _steps([*extra, "optim.fused=false"])
    assert fused.defaults["fused"] is True and not loop.defaults["fused"]
    for a, b in zip(fused_params, loop_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
