"""Boolean-mask assignment on sharded tensors equals one device, forward and backward.

``x[mask] = value`` (a number or a one-element tensor: a local fill, nothing sent),
``x[mask] = values`` (1-D, one value per True element in global row-major order) and
``masked_scatter`` (the source's first values) with masks and values in any layout.  Before,
``__setitem__`` handed the whole mask to torch's ``index_put_`` on the slab (an IndexError) and
``masked_scatter`` had no sharding rule.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_shape_ops import LAYOUTS, SHAPES, check_family, randn, run_combos, sharding, world_of

_NAN, _INF = torch.full((), float("nan")), torch.full((), float("inf"))


def _set(x: torch.Tensor, mask: torch.Tensor, value: float | torch.Tensor) -> torch.Tensor:
    out = x.clone()
    out[mask] = value
    return out


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN where ``x < 0`` and inf where ``x < -1``: the positions the mask ``x < 0`` overwrites."""
    return torch.where(x < -1, _INF, torch.where(x < 0, _NAN, x))


FAMILY: dict[str, Callable] = {
    "o[x > 0.3] = 0": lambda x: _set(x, x > 0.3, 0.0),
    "o[(x > 0.3,)] = -2 (a tuple key)": lambda x: _set(x, (x > 0.3,), -2.0),
    "o[x > 0.3] = x.sum() / 10 (0-d tensor)": lambda x: _set(x, x > 0.3, x.sum() / 10),
    "o[x < 0] = x.amax().reshape(1, 1) (numel 1)": lambda x: _set(x, x < 0, x.amax().reshape(1, 1)),
    "o[x < 0] = 0.5 over NaN and inf": lambda x: _set(_poisoned(x), x < 0, 0.5),
    "o[x > 0.3] = (2x)[x > 0.3]": lambda x: _set(x, x > 0.3, (x * 2)[x > 0.3]),
    "o[x < 0] = (x * x)[x < 0] over NaN and inf": lambda x: _set(_poisoned(x), x < 0, (x * x)[x < 0]),
    "o[x > 9] = 1 (all False)": lambda x: _set(x, x > 9, 1.0),
    "o[x > 9] = x[x > 9] (all False)": lambda x: _set(x, x > 9, x[x > 9]),
    "o[x > -9] = (3x)[x > -9] (all True)": lambda x: _set(x, x > -9, (3 * x)[x > -9]),
    "o[x > -9] = 7 (all True)": lambda x: _set(x, x > -9, 7.0),
    "o[x > 0] = o[x > 0] + 1": lambda x: _set(x, x > 0, x[x > 0] + 1),
    "masked_scatter(x, x > 0, (2x)[x > 0])": lambda x: torch.masked_scatter(x, x > 0, (2 * x)[x > 0]),
    "x.masked_scatter(x < 0, longer source)": lambda x: x.masked_scatter(x < 0, (3 * x)[x > -9]),
    "o.masked_scatter_(x < 0, (x + 1)[x < 0]) over NaN": lambda x: _poisoned(x).masked_scatter_(x < 0, (x + 1)[x < 0]),
    "masked_scatter with a plain source": lambda x: x.masked_scatter(x > 0, torch.linspace(-1, 1, x.numel())),
}


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mask_assignment_matches_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)


# ----- masks and values as separate inputs, in their own layouts ----------------------------------------
def _put(x: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return _set(x, mask, values)


def _put_into_constant(x: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Only the values require grad: the destination is a constant."""
    return _set(x.detach(), mask, values)


def _scatter(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return x.masked_scatter(mask, source)


def _check_operands(layout: str) -> list[str]:
    combos = {}
    for split, shape in SHAPES.items():
        mesh, placements, sizes = sharding(layout, split, shape)
        replicated = [Replicate()] * mesh.ndim
        other = [Shard(3)] + replicated[1:]  # the mask split along W on the first axis (x: H)
        vector = [Shard(0)] + replicated[1:]  # values split evenly, not like x[mask]
        x, mask = randn(shape), randn(shape, 1) > 0
        values, longer = randn((int(mask.sum()),), 2), randn((int(mask.sum()) + 5,), 3)
        cases = {
            "o[plain mask] = plain values": (_put, None, None),
            "o[replicated mask] = values split evenly": (_put, replicated, vector),
            "o[mask split along W] = replicated values": (_put, other, replicated),
            "constant[mask] = values split evenly": (_put_into_constant, placements, vector),
            "masked_scatter(x, plain mask, longer source split evenly)": (_scatter, None, vector),
            "masked_scatter(x, mask, longer plain source)": (_scatter, placements, None),
        }
        for name, (fn, mask_placements, value_placements) in cases.items():
            source = longer if fn is _scatter else values
            inputs = [x, mask, source]
            where = [placements, mask_placements, value_placements]
            split_sizes = [sizes, sizes if mask_placements is placements else None, None]
            combos[f"{name} on {layout} ({split})"] = _operands_check(fn, inputs, mesh, where, split_sizes)
    return run_combos(combos)


def _operands_check(fn: Callable, inputs: list, mesh, placements: list, sizes: list) -> Callable[[], None]:
    return lambda: assert_sharded_matches(fn, inputs, mesh, placements, sharding_sizes=sizes)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_masks_and_values_in_other_layouts(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check_operands, layout)[0]
    assert len(checked) == 3 * 6


# ----- splits, no autograd, traffic, errors ------------------------------------------------------------------
def _three_ranks_with_an_empty_shard() -> list[str]:
    mesh = get_mesh((3,))
    x = randn((2, 3, 7, 5))
    check = {name: _family_check(fn, x, mesh) for name, fn in FAMILY.items()}
    return run_combos(check)


def _family_check(fn: Callable, x: torch.Tensor, mesh) -> Callable[[], None]:
    return lambda: assert_sharded_matches(fn, [x], mesh, [[Shard(2)]], sharding_sizes=[{0: [3, 0, 4]}])


def test_three_ranks_split_3_0_4() -> None:
    assert len(run_on_ranks(3, _three_ranks_with_an_empty_shard)[0]) == len(FAMILY)


def _without_autograd(layout: str) -> None:
    """Forward with no input requiring grad, and under ``no_grad`` with one that does."""
    for split, shape in SHAPES.items():
        mesh, placements, sizes = sharding(layout, split, shape)
        x = randn(shape)
        for name, fn in FAMILY.items():
            assert_sharded_matches(fn, [x], mesh, [placements], sharding_sizes=[sizes], check_grads=False)
            sharded = distribute_tensor(x, mesh, placements, sizes).requires_grad_(True)
            with torch.no_grad():
                out = fn(sharded)
            assert not out.requires_grad and torch.allclose(out.full_tensor(), fn(x), atol=1e-6), (name, split)


@pytest.mark.parametrize("layout", ["2", "2x2"])
def test_without_autograd(layout: str) -> None:
    run_on_ranks(world_of(layout), _without_autograd, layout)


def _scalar_assignment_sends_nothing() -> None:
    mesh, placements, sizes = sharding("3", "skewed", (2, 3, 7, 5))
    values = randn((2, 3, 7, 5))
    x = distribute_tensor(values, mesh, placements, sizes)
    mask = x > 0.3
    with count_communication() as log:
        x[mask] = 0.0
        x[values < -1] = torch.tensor(2.0)  # a plain mask, every rank holding it whole
        x[mask] = torch.ones(1)  # numel 1: broadcast
    assert log.calls == 0, log.kinds()
    assert torch.equal(x.full_tensor(), _set(_set(values, values > 0.3, 0.0), values < -1, 2.0).masked_fill(values > 0.3, 1.0))


def _values_travel_only_where_needed() -> int:
    """``o[mask] = y[mask]`` on 2 ranks: per-row counts and only the values another rank writes."""
    mesh, placements, sizes = sharding("2", "uneven", (2, 3, 7, 5))
    values = randn((2, 3, 7, 5))
    x = distribute_tensor(values, mesh, placements, sizes)
    mask = x > 0.3
    picked = (2 * x)[mask]
    with count_communication() as log:
        x[mask] = picked
    assert torch.equal(x.full_tensor(), _set(values, values > 0.3, (2 * values)[values > 0.3]))
    assert set(log.kinds()) == {"all_to_all"}, log.kinds()
    counts_bytes = 2 * 3 * 8  # one int64 count per (N, C) row
    assert log.bytes_sent <= counts_bytes + int(mask._local_tensor.sum()) * 4 < x._local_tensor.numel() * 4
    return log.bytes_sent


def test_traffic() -> None:
    run_on_ranks(3, _scalar_assignment_sends_nothing)
    sent = run_on_ranks(2, _values_travel_only_where_needed)
    assert all(s > 0 for s in sent), sent


def _unsupported_raises_on_every_rank() -> list[str]:
    mesh = get_mesh((2,))
    values = randn((2, 3, 7, 5))
    x = distribute_tensor(values, mesh, [Shard(2)])
    errors = []
    attempts = {
        "too few values": lambda: x.clone().__setitem__(x > 0, x[x > 0][1:]),
        "2-D values": lambda: x.clone().__setitem__(x > 0, x[x > 0].unsqueeze(1)),
        "another dtype": lambda: x.clone().__setitem__(x > 0, x[x > 0].double()),
        "short source": lambda: x.masked_scatter(x > 0, x[x > 0.5]),
        "sharded multi-dim source": lambda: x.masked_scatter(x > 0, 2 * x),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except (IndexError, RuntimeError, NotImplementedError) as error:  # ShardedOpError: NotImplementedError
            errors.append(f"{name}: {type(error).__name__}: {error}")
    return errors


def test_unsupported_raises_on_every_rank() -> None:
    first, second = run_on_ranks(2, _unsupported_raises_on_every_rank)
    assert first == second, (first, second)
    expected = {
        "too few values": "IndexError: x[mask] = v: value of shape",
        "2-D values": "IndexError: x[mask] = v: value of shape",
        "another dtype": "RuntimeError: x[mask] = v: expected values of dtype",
        "short source": "RuntimeError: masked_scatter: number of elements of source",
        "sharded multi-dim source": "ShardedOpError: masked_scatter on ShardTensor(s)",
    }
    assert len(first) == len(expected), first
    for line, (name, start) in zip(first, expected.items()):
        assert line.startswith(f"{name}: {start}"), line
