"""``compile_in_place`` with inductor buckets a compiled backward's parameter-gradient all-reduces.

A traced backward sums each use of a parameter over the domain axis with its own all-reduce (no
end-of-pass callback can bucket them inside a compiled graph). Inductor's bucketing pass, which
``compile_in_place`` turns on, issues the independent ones together: fewer collectives per step,
the same gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.profiler import ProfilerActivity, profile

from physics_dp.nn import compile_in_place
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

pytestmark = pytest.mark.usefixtures("fresh_rank_processes")


def _net() -> nn.Module:
    """Four convolutions with bias (eight parameter uses whose gradients need a sum), no norm."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1), nn.SiLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 4, 3, padding=1),
    )


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


def _all_reduces_per_compiled_step(through_compile_in_place: bool) -> dict:
    mesh = get_mesh((2,))
    eager = _net()
    compiled = copy.deepcopy(eager)
    x = distribute_tensor(torch.randn(1, 4, 12, 8), mesh, [Shard(2)])
    _step(eager, x)
    torch._dynamo.reset()
    if through_compile_in_place:
        compile_in_place(compiled, "inductor")
    else:  # as compile_in_place compiled before it passed inductor its options
        compiled.compile(backend="inductor", dynamic=False)
    _step(compiled, x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(compiled, x)
    all_reduces = sum(e.count for e in prof.key_averages() if e.key == "c10d::allreduce_")
    diff = max((pc.grad - pe.grad).abs().max().item() for pe, pc in zip(eager.parameters(), compiled.parameters()))
    return {"all_reduces": all_reduces, "diff": diff}


def test_inductor_buckets_the_parameter_sums_of_a_compiled_backward() -> None:
    """Eight parameter uses: one all-reduce each unbucketed, fewer bucketed (4 with torch 2.13: each
    convolution's weight and bias together), and the gradients equal eager's either way."""
    unbucketed = run_on_ranks(2, _all_reduces_per_compiled_step, False, timeout=600)
    bucketed = run_on_ranks(2, _all_reduces_per_compiled_step, True, timeout=600)
    for result in unbucketed + bucketed:
        assert result["diff"] <= 1e-5, result
    assert [r["all_reduces"] for r in unbucketed] == [8, 8], (unbucketed, bucketed)
    assert all(r["all_reduces"] < 8 for r in bucketed), (unbucketed, bucketed)
