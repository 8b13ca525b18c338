"""Every activation of ``torch.nn.functional`` on sharded tensors equals one device, forward and backward.

Several activation gradients (hardtanh / relu6, hardswish, hardsigmoid, the shrinks, logsigmoid)
are elementwise aten ops that torch does not tag pointwise and DTensor has no rule for; prelu's
fused backward also reduces the weight's gradient.  All of them raised in backward before.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import distribute_tensor
from physics_dp.testing import run_on_ranks

from .test_shape_ops import LAYOUTS, check_family, randn, sharding, world_of

_SLOPES = torch.tensor([0.1, 0.25, 0.4])

FAMILY: dict[str, Callable] = {
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.5),
    "relu6(3x)": lambda x: F.relu6(3 * x),
    "hardswish(3x)": lambda x: F.hardswish(3 * x),
    "hardsigmoid(3x)": lambda x: F.hardsigmoid(3 * x),
    "softshrink": lambda x: F.softshrink(x, 0.3),
    "hardshrink": lambda x: F.hardshrink(x, 0.3),
    "logsigmoid": lambda x: F.logsigmoid(x),
    "prelu, a weight per channel": lambda x: F.prelu(x, _SLOPES),
    "prelu, one weight": lambda x: torch.prelu(x, _SLOPES[:1]),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "elu, selu, celu": lambda x: F.elu(x) + F.selu(x) + F.celu(x, 0.5),
    "softplus": lambda x: F.softplus(x, 2.0, 1.0),
    "mish": lambda x: F.mish(x),
    "gelu(tanh)": lambda x: F.gelu(x, approximate="tanh"),
    "silu, tanhshrink, softsign": lambda x: F.silu(x) * F.tanhshrink(x) + F.softsign(x),
    "rrelu (eval)": lambda x: F.rrelu(x, training=False),
    "threshold": lambda x: F.threshold(x, 0.1, 2.0),
}


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_activations_match_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)


def _prelu_weight_gradient_is_summed_once() -> None:
    """nn.PReLU's weight gradient: one sum over the mesh, equal to one device's; nothing else sent."""
    mesh, placements, sizes = sharding("3", "skewed", (2, 3, 7, 5))
    values = randn((2, 3, 7, 5))
    module = torch.nn.PReLU(3)
    x = distribute_tensor(values, mesh, placements, sizes).requires_grad_(True)
    with count_communication() as log:
        module(x).sum().backward()
    reference = torch.nn.PReLU(3)
    reference(values).sum().backward()
    assert torch.allclose(module.weight.grad, reference.weight.grad, atol=1e-5)
    assert [kind for kind in log.kinds() if kind != "all_reduce"] == [], log.kinds()


def test_prelu_weight_gradient_is_summed_once() -> None:
    run_on_ranks(3, _prelu_weight_gradient_is_summed_once)
