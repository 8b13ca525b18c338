"""Sharded reductions equal one device: sum, mean, var/std, max/min, arg*, norms, logsumexp.

Every function runs on the layouts and splits of ``test_normalization`` (1-4 ranks, H x W on a
2x2 mesh, batch x H on a ("data", "domain") mesh; even, uneven and skewed splits with an empty
shard), over sharded and unsharded dims, dim=None and keepdim, forward and backward, on a
random input and on a small-integer input full of ties (argmax picks the first occurrence,
amax's gradient splits over every tie).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops._local import ShardedOpError
from physics_dp.shard_tensor import Partial, Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_normalization import LAYOUTS, SHAPES, randn, run_combos, sharding, world_of

inf = math.inf

# name -> function of x of shape (N, C, H, W); H and W (or N and H) are the sharded dims
FUNCTIONS: dict[str, Callable[[torch.Tensor], object]] = {
    "sum()": lambda x: x.sum(),
    "sum((2, 3))": lambda x: x.sum((2, 3)),
    "sum(2, keepdim)": lambda x: torch.sum(x, 2, keepdim=True),
    "sum(1)": lambda x: x.sum(1),
    "sum(-1, dtype=float64)": lambda x: x.sum(-1, dtype=torch.float64),
    "mean()": lambda x: x.mean(),
    "mean(2)": lambda x: x.mean(2),
    "mean((0, 2, 3), keepdim)": lambda x: x.mean((0, 2, 3), keepdim=True),
    "mean(1)": lambda x: torch.mean(x, 1),
    "var()": lambda x: x.var(),
    "var(2)": lambda x: torch.var(x, 2),
    "var((2, 3), correction=0)": lambda x: x.var((2, 3), correction=0),
    "var(1)": lambda x: x.var(1),
    "std(2, keepdim, unbiased=False)": lambda x: x.std(2, keepdim=True, unbiased=False),
    "std((1, 2, 3), correction=2)": lambda x: torch.std(x, (1, 2, 3), correction=2),
    "var_mean(2)": lambda x: torch.var_mean(x, 2),
    "std_mean((0, 3))": lambda x: torch.std_mean(x, (0, 3)),
    "max()": lambda x: x.max(),
    "min()": lambda x: torch.min(x),
    "max(2)": lambda x: x.max(2),
    "min(3, keepdim)": lambda x: torch.min(x, 3, keepdim=True),
    "max(0)": lambda x: torch.max(x, 0),
    "max(1)": lambda x: x.max(1),
    "amax((2, 3))": lambda x: x.amax((2, 3)),
    "amin(2, keepdim)": lambda x: x.amin(2, keepdim=True),
    "amax()": lambda x: torch.amax(x, (0, 1, 2, 3)),
    "aminmax(dim=2)": lambda x: torch.aminmax(x, dim=2),
    "aminmax(dim=3, keepdim)": lambda x: x.aminmax(dim=3, keepdim=True),
    "aminmax()": lambda x: torch.aminmax(x),
    "argmax()": lambda x: x.argmax(),
    "argmin(keepdim)": lambda x: torch.argmin(x, keepdim=True),
    "argmax(2)": lambda x: x.argmax(2),
    "argmin(3, keepdim)": lambda x: x.argmin(3, keepdim=True),
    "argmax(0)": lambda x: torch.argmax(x, 0),
    "norm()": lambda x: x.norm(),
    "norm(p=1, dim=2)": lambda x: x.norm(p=1, dim=2),
    "norm(p=inf, dim=(2, 3))": lambda x: torch.norm(x, p=inf, dim=(2, 3)),
    "norm(p='fro', dim=(2, 3))": lambda x: torch.norm(x, p="fro", dim=(2, 3)),
    "vector_norm(ord=3, dim=2, keepdim)": lambda x: torch.linalg.vector_norm(x, 3, 2, keepdim=True),
    "vector_norm(ord=0, dim=3)": lambda x: torch.linalg.vector_norm(x, 0, 3),
    "vector_norm(ord=-inf, dim=2)": lambda x: torch.linalg.vector_norm(x, -inf, 2),
    "F.normalize(dim=2)": lambda x: torch.nn.functional.normalize(x, dim=2),
    "logsumexp(2)": lambda x: x.logsumexp(2),
    "logsumexp((0, 1, 2, 3), keepdim)": lambda x: torch.logsumexp(x, (0, 1, 2, 3), keepdim=True),
    "logsumexp(1)": lambda x: x.logsumexp(1),
    "prod(2)": lambda x: x.prod(2),
    "prod(3, keepdim)": lambda x: torch.prod(x, 3, keepdim=True),
    "any()": lambda x: (x > 0).any(),
    "all(2)": lambda x: (x > -1).all(2),
    "any(3) as float, doubled": lambda x: (x > 1).any(3).float() * 2,
    "all() as float": lambda x: (x > -2).all().float(),
}
INPUTS = {
    "randn": lambda shape: randn(shape),
    "ties": lambda shape: torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(1)).float(),
}


def _check_layout(layout: str, input_kind: str) -> list[str]:
    combos = {}
    for split, shape in SHAPES.items():
        mesh, placements, sizes = sharding(layout, split, shape)
        x = INPUTS[input_kind](shape)
        for name, fn in FUNCTIONS.items():
            combos[f"{name} on {layout} ({split}, {input_kind})"] = (
                lambda fn=fn, x=x, mesh=mesh, placements=placements, sizes=sizes: assert_sharded_matches(
                    fn, [x], mesh, [placements], sharding_sizes=[sizes]
                )
            )
    return run_combos(combos)


@pytest.mark.parametrize("input_kind", sorted(INPUTS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reduction_matches_single_device(layout: str, input_kind: str) -> None:
    checked = run_on_ranks(world_of(layout), _check_layout, layout, input_kind)[0]
    assert len(checked) == len(SHAPES) * len(FUNCTIONS)


# ----- placements and communication -----------------------------------------------------------------
def _placements_and_traffic() -> dict[str, object]:
    mesh, placements, sizes = sharding("2x2-HxW", "uneven", SHAPES["uneven"])
    x = distribute_tensor(randn(SHAPES["uneven"]), mesh, placements, sizes)
    seen = {}
    for name, fn, expected, calls in (
        ("sum((2, 3))", lambda t: t.sum((2, 3)), (Replicate(), Replicate()), 1),  # one collective over the job
        ("mean(2)", lambda t: t.mean(2), (Replicate(), Shard(2)), 1),
        ("amax(3, keepdim)", lambda t: t.amax(3, keepdim=True), (Shard(2), Replicate()), 1),
        ("var(1)", lambda t: t.var(1), (Shard(1), Shard(2)), 0),
        ("argmax()", lambda t: t.argmax(), (Replicate(), Replicate()), 1),
    ):
        with count_communication() as log:
            y = fn(x)
        assert y.placements == expected, f"{name}: {y.placements}"
        kept = tuple(x._spec.axis_sizes[a] if type(p) is Shard else None for a, p in enumerate(expected))
        assert y._spec.axis_sizes == kept, name
        assert log.calls == calls, f"{name}: {log.kinds()}"
        seen[name] = log.kinds()
    return seen


def test_output_placements_and_collective_counts() -> None:
    run_on_ranks(4, _placements_and_traffic)


def _traffic_at_two_sizes() -> dict[str, list]:
    """Each reduction sends output-sized payloads: the same collectives for a 5x longer reduced dim."""
    mesh = get_mesh((2,))
    functions = {
        "sum((2, 3))": lambda t: t.sum((2, 3)),
        "mean(2)": lambda t: t.mean(2),
        "var(2)": lambda t: t.var(2),
        "amax(2)": lambda t: t.amax(2),
        "max(2)": lambda t: t.max(2),
        "logsumexp(2)": lambda t: t.logsumexp(2),
        "norm(dim=2)": lambda t: t.norm(dim=2),
    }
    traffic: dict[str, list] = {}
    for shape in ((2, 3, 13, 5), (2, 3, 65, 5)):
        x = distribute_tensor(randn(shape), mesh, [Shard(2)])
        for name, fn in functions.items():
            with count_communication() as log:
                fn(x)
            traffic.setdefault(name, []).append([(r.kind, r.bytes_sent) for r in log.records])
    for name, (small, large) in traffic.items():
        assert len(small) == 1 and small == large, f"{name}: {small} vs {large}"
    return traffic


def test_reduction_bytes_do_not_grow_with_the_reduced_extent() -> None:
    run_on_ranks(2, _traffic_at_two_sizes)


# ----- numerics and edge cases ----------------------------------------------------------------------
VARIANCES = {
    "var(2)": lambda x: x.var(2),
    "std()": lambda x: x.std(),
    "var_mean((2, 3))": lambda x: torch.var_mean(x, (2, 3)),
}
EXTREMES = {
    "max(2)": lambda x: x.max(2),
    "argmin()": lambda x: x.argmin(),
    "amax()": lambda x: x.amax(),
    "min()": lambda x: x.min(),
}
SUMS = {"sum(2)": lambda x: x.sum(2), "mean()": lambda x: x.mean(), "norm(dim=2)": lambda x: x.norm(dim=2)}


def _edge_inputs(shape: tuple[int, ...]) -> dict[str, tuple[torch.Tensor, dict, dict]]:
    """label -> (input, functions, options for assert_sharded_matches)."""
    generator = torch.Generator().manual_seed(2)
    nan = randn(shape)
    nan[0, 1, 10, 2] = nan[1, 2, 12, 0] = math.nan  # on the last shard of H
    ints = torch.randint(-5, 6, shape, generator=generator)
    return {
        # E[x^2] - E[x]^2 would lose the variance entirely.  In float32 the mean itself carries an
        # ulp of 1e4 (~1e-3), which x - mean in var's backward inherits on one device too.
        "float32 1e4 + N(0, 1)": (1e4 + randn(shape), VARIANCES, {"check_grads": False}),
        "float64 1e8 + N(0, 1)": (1e8 + randn(shape, dtype=torch.float64), VARIANCES, {}),
        "NaN": (nan, EXTREMES, {"check_grads": False}),
        "int64": (ints, {**EXTREMES, "sum(2)": lambda x: x.sum(2)}, {}),
        "bool": (ints > 0, {"sum()": lambda x: x.sum(), "amax(2)": lambda x: x.amax(2), "max(2)": lambda x: x.max(2)}, {}),
        "complex64": (torch.randn(shape, dtype=torch.complex64, generator=generator), SUMS, {}),
        "bfloat16": (randn(shape).bfloat16(), SUMS, {"atol": 1e-2, "rtol": 1e-2}),
    }


def _edge_cases() -> list[str]:
    shape = SHAPES["uneven"]
    mesh, placements, sizes = sharding("3", "skewed", shape)
    combos = {}
    for label, (x, functions, options) in _edge_inputs(shape).items():
        for name, fn in functions.items():
            combos[f"{name} on {label}"] = lambda fn=fn, x=x, options=options: assert_sharded_matches(
                fn, [x], mesh, [placements], sharding_sizes=[sizes], **options
            )
    return run_combos(combos)


def test_large_offset_nan_integer_and_low_precision_inputs() -> None:
    run_on_ranks(3, _edge_cases)


def _half_precision_sums_round_once() -> bool:
    """One rank's partial sum (70000) overflows float16; one device accumulates in float32 and
    rounds the total (10000) once, and so must the sharded sum, on plain and strided layouts."""
    values = torch.tensor([40000.0, 30000.0, -30000.0, -30000.0, 0, 0, 0, 0], dtype=torch.float16)
    split = distribute_tensor(values, get_mesh((4,)), [Shard(0)])
    for fn in (lambda t: t.sum(), lambda t: t.nansum(), lambda t: t.sum(0), lambda t: torch.einsum("i->", t)):
        assert torch.equal(fn(split).full_tensor(), fn(values)), fn(split).full_tensor()
    grid = torch.zeros(1, 1, 4, 4, dtype=torch.float16)
    grid[0, 0, 0, :2] = values[:2]  # on the rank holding the (0, 0) block
    grid[0, 0, 3, 2:] = values[2:4]
    tokens = distribute_tensor(grid, get_mesh((2, 2)), [Shard(2), Shard(3)]).flatten(2)
    for fn in (lambda t: t.sum(2), lambda t: t.mean(2)):
        assert torch.equal(fn(tokens).full_tensor(), fn(grid.flatten(2))), fn(tokens).full_tensor()
    return True


def test_half_precision_partial_sums_do_not_overflow() -> None:
    assert all(run_on_ranks(4, _half_precision_sums_round_once))


def _partial_input() -> bool:
    """A pending sum is applied before reducing."""
    mesh = get_mesh((2,))
    x = randn((3, 5))
    xs = ShardTensor.from_local(x / 2, mesh, [Partial("sum")])
    for fn in (lambda t: t.sum(0), lambda t: t.amax(), lambda t: t.var(1), lambda t: t.argmax()):
        torch.testing.assert_close(fn(xs).full_tensor(), fn(x))
    return True


def test_partial_input_is_reduced_first() -> None:
    run_on_ranks(2, _partial_input)


def _complex_refused() -> str:
    mesh = get_mesh((2,))
    x = distribute_tensor(torch.randn(4, 6, dtype=torch.complex64), mesh, [Shard(1)])
    with pytest.raises(ShardedOpError) as info:
        x.var(1)
    message = str(info.value)
    assert "var" in message and "Shard(dim=1)" in message and "complex" in message, message
    return message


def test_complex_reduction_over_a_sharded_dim_raises() -> None:
    run_on_ranks(2, _complex_refused)
