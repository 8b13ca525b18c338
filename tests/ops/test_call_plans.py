"""Per-call plans of the halo paths: built once per call signature, holding no mesh or process group."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from physics_dp.ops.call_plans import HaloPlan, PlanCache, hashable
from physics_dp.shard_tensor import Shard, ShardTensorSpec
from physics_dp.testing import assert_sharded_matches, get_mesh, run_on_ranks

from .test_views import holds_a_mesh


def _cache_behaviour():
    mesh = get_mesh((2,))
    spec = ShardTensorSpec(mesh, [Shard(2)], (1, 3, 10, 4), [(3, 7)])
    cache, built = PlanCache(limit=3), []

    def build(result):
        built.append(result)
        return result

    plan = HaloPlan(("geometry",), 0, spec)
    first = cache.plan(("a",), mesh, lambda: build(plan))
    again = cache.plan(("a",), mesh, lambda: build(plan))
    assert first is plan and again == plan and again.out_spec == spec and again.out_spec.mesh is mesh
    assert cache.plan(("general",), mesh, lambda: build(None)) is None
    assert cache.plan(("general",), mesh, lambda: build(None)) is None
    assert len(built) == 2  # each key built once, None included
    assert not holds_a_mesh(cache.entries())
    cache.plan(("b",), mesh, lambda: build(plan))
    cache.plan(("c",), mesh, lambda: build(plan))  # the limit: the cache starts over
    assert list(cache.entries()) == [("c",)]
    return True


def test_a_plan_is_built_once_per_key_and_its_spec_comes_back_on_the_callers_mesh():
    assert all(run_on_ranks(2, _cache_behaviour))


def test_list_arguments_become_keys():
    assert hashable([1, [2, 3]]) == (1, (2, 3))
    assert hashable("same") == "same"


def _layer(op: str, step: int) -> nn.Module:
    """One layer per op; ``step`` (1 or 2) changes its signature: the conv's stride, the upsampling's
    factor, the 'same' stencil's dilation (the halo path of unfold and fold takes stride 1 only)."""
    if op == "conv":
        return nn.Conv2d(3, 4, 3, stride=step, padding=1)
    if op == "unfold":
        return nn.Unfold(3, dilation=step, padding=step)
    if op == "unfold and fold":
        return nn.Sequential(nn.Unfold(3, dilation=step, padding=step), nn.Fold((12, 5), 3, dilation=step, padding=step))
    return nn.Upsample(scale_factor=2 * step, mode="bilinear")


_BUILDERS = {  # op -> (module, the plan builders its calls run)
    "conv": ("conv", ["_halo_conv_plan"]),
    "interpolate": ("interpolation", ["_halo_resample_plan"]),
    "unfold": ("unfold", ["_halo_unfold_plan"]),
    "unfold and fold": ("unfold", ["_halo_unfold_plan", "_halo_fold_plan"]),
}


def _planned_once_per_signature(op: str):
    """Calls with repeated signatures (split, stride or factor): each signature is planned once, the
    results equal one device's, and the cache holds no mesh or process group."""
    module_name, builders = _BUILDERS[op]
    module = importlib.import_module(f"physics_dp.ops.{module_name}")
    originals, built = {name: getattr(module, name) for name in builders}, []

    def counting(original):
        def build(*args):
            built.append(args)
            return original(*args)

        return build

    mesh = get_mesh((2,))
    full = torch.randn(1, 3, 12, 5, generator=torch.Generator().manual_seed(3))
    module._HALO_PLANS.clear()
    for name, original in originals.items():
        setattr(module, name, counting(original))
    try:
        for sizes, step in (((6, 6), 1), ((6, 6), 1), ((4, 8), 1), ((6, 6), 2), ((4, 8), 1), ((6, 6), 2)):
            torch.manual_seed(0)
            assert_sharded_matches(_layer(op, step), [full], mesh, [[Shard(2)]], sharding_sizes=[{0: list(sizes)}])
    finally:
        for name, original in originals.items():
            setattr(module, name, original)
    entries = module._HALO_PLANS.entries()
    halo_plans = sum(entry is not None for entry in entries.values())  # every call took the halo path
    return len(built), halo_plans, holds_a_mesh(entries)


@pytest.mark.parametrize("op", sorted(_BUILDERS))
def test_halo_paths_plan_each_call_signature_once_and_hold_no_mesh(op):
    planned_ops = len(_BUILDERS[op][1])
    for built, halo_plans, holds in run_on_ranks(2, _planned_once_per_signature, op):
        assert (built, halo_plans) == (3 * planned_ops, 3 * planned_ops)
        assert not holds
