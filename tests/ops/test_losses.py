"""Losses reduced over a sharded grid equal one device, forward and backward (ops/losses.py).

Every function takes the same global inputs, split alike: ``x`` (N, C, H, W) scores, ``y`` real
targets, ``p`` probabilities in (0, 1), and ``t`` (N, H, W) class indices (some ignored, -100),
split as ``x`` without its class dim.  Layouts and splits (even, uneven, an empty shard) are
those of test_shape_ops.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from physics_dp.ops._local import ShardedOpError
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_shape_ops import LAYOUTS, SHAPES, randn, run_combos, sharding, world_of

REDUCTIONS = ("none", "mean", "sum")
_IGNORED = -100


def _fixed(*shape: int, seed: int = 7) -> torch.Tensor:
    """A positive weight, equal on every rank."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) + 0.25


def _elementwise(r: str) -> dict[str, Callable]:
    return {
        f"mse_loss {r}": lambda x, y, p, t: F.mse_loss(x, y, reduction=r),
        f"mse_loss weighted {r}": lambda x, y, p, t: F.mse_loss(x, y, reduction=r, weight=p.detach() + 0.5),
        f"l1_loss {r}": lambda x, y, p, t: F.l1_loss(x, y, reduction=r),
        f"huber_loss {r}": lambda x, y, p, t: F.huber_loss(x, y, reduction=r, delta=0.5),
        f"huber_loss weighted {r}": lambda x, y, p, t: F.huber_loss(x, y, reduction=r, weight=p.detach() + 0.5),
        f"smooth_l1_loss {r}": lambda x, y, p, t: F.smooth_l1_loss(x, y, reduction=r, beta=0.5),
        f"binary_cross_entropy {r}": lambda x, y, p, t: F.binary_cross_entropy(torch.sigmoid(x), p, reduction=r),
        f"binary_cross_entropy weight {r}": lambda x, y, p, t: F.binary_cross_entropy(
            torch.sigmoid(x), p, weight=_fixed(x.shape[1], 1, 1), reduction=r
        ),
        f"bce_with_logits {r}": lambda x, y, p, t: F.binary_cross_entropy_with_logits(x, p, reduction=r),
        f"bce_with_logits weight, pos_weight {r}": lambda x, y, p, t: F.binary_cross_entropy_with_logits(
            x, p, weight=_fixed(x.shape[-1]), pos_weight=_fixed(x.shape[1], 1, 1, seed=3), reduction=r
        ),
        f"soft_margin_loss {r}": lambda x, y, p, t: F.soft_margin_loss(x, y.detach().sign(), reduction=r),
        f"poisson_nll_loss {r}": lambda x, y, p, t: F.poisson_nll_loss(x, 3 * p, reduction=r),
        f"poisson_nll_loss full {r}": lambda x, y, p, t: F.poisson_nll_loss(
            x.exp(), 3 * p, log_input=False, full=True, reduction=r
        ),
        f"gaussian_nll_loss {r}": lambda x, y, p, t: F.gaussian_nll_loss(x, y, p[:, :1] + 0.1, reduction=r),
        f"kl_div {r}": lambda x, y, p, t: F.kl_div(F.log_softmax(x, 1), p, reduction=r),
        f"hinge_embedding_loss {r}": lambda x, y, p, t: F.hinge_embedding_loss(x, y.detach().sign(), reduction=r),
        f"margin_ranking_loss {r}": lambda x, y, p, t: F.margin_ranking_loss(x, y, p.detach().round() * 2 - 1, reduction=r),
    }


ELEMENTWISE: dict[str, Callable] = {name: fn for r in REDUCTIONS for name, fn in _elementwise(r).items()}
ELEMENTWISE |= {
    "kl_div batchmean": lambda x, y, p, t: F.kl_div(F.log_softmax(x, 1), p, reduction="batchmean"),
    "kl_div batchmean log_target": lambda x, y, p, t: F.kl_div(
        F.log_softmax(x, 1), F.log_softmax(y, 1), reduction="batchmean", log_target=True
    ),
    "mse_loss size_average=False": lambda x, y, p, t: F.mse_loss(x, y, size_average=False),
    "smooth_l1_loss reduce=False": lambda x, y, p, t: F.smooth_l1_loss(x, y, reduce=False),
    "bce_with_logits of sharded x, plain target": lambda x, y, p, t: F.binary_cross_entropy_with_logits(
        x, torch.ones(x.shape) / 3
    ),
}


def _classes(r: str) -> dict[str, Callable]:
    return {
        f"nll_loss {r}": lambda x, y, p, t: F.nll_loss(F.log_softmax(x, 1), t, reduction=r),
        f"nll_loss weight {r}": lambda x, y, p, t: F.nll_loss(F.log_softmax(x, 1), t, weight=_fixed(3), reduction=r),
        f"nll_loss ignore_index=1 {r}": lambda x, y, p, t: F.nll_loss(
            F.log_softmax(x, 1), t.clamp(min=0), ignore_index=1, reduction=r
        ),
        f"cross_entropy {r}": lambda x, y, p, t: F.cross_entropy(x, t, reduction=r),
        f"cross_entropy weight {r}": lambda x, y, p, t: F.cross_entropy(x, t, weight=_fixed(3), reduction=r),
        f"cross_entropy label_smoothing {r}": lambda x, y, p, t: F.cross_entropy(x, t, label_smoothing=0.2, reduction=r),
        f"cross_entropy weight, label_smoothing {r}": lambda x, y, p, t: F.cross_entropy(
            x, t, weight=_fixed(3), label_smoothing=0.3, reduction=r
        ),
        f"cross_entropy probabilities {r}": lambda x, y, p, t: F.cross_entropy(x, F.softmax(y, 1), reduction=r),
        f"cross_entropy probabilities weight, label_smoothing {r}": lambda x, y, p, t: F.cross_entropy(
            x, p, weight=_fixed(3), label_smoothing=0.1, reduction=r
        ),
    }


CLASSES: dict[str, Callable] = {name: fn for r in REDUCTIONS for name, fn in _classes(r).items()}
CLASSES |= {
    "cross_entropy(x, argmax)": lambda x, y, p, t: F.cross_entropy(x, x.detach().argmax(1)),
    "nll_loss size_average=False": lambda x, y, p, t: F.nll_loss(F.log_softmax(x, 1), t, size_average=False),
    "CrossEntropyLoss module": lambda x, y, p, t: torch.nn.CrossEntropyLoss(weight=_fixed(3), label_smoothing=0.1)(x, t),
}
FAMILIES = {"elementwise": ELEMENTWISE, "classes": CLASSES}


def _class_targets(shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    t = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=generator)
    return t.masked_fill(torch.rand(t.shape, generator=generator) < 0.2, _IGNORED)


def _target_placements(placements: list) -> list:
    """The placements of a class-index target split like an input with these placements."""
    return [Shard(p.dim - 1) if type(p) is Shard and p.dim > 1 else p for p in placements]


def _inputs(shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [randn(shape), randn(shape, seed=1), torch.sigmoid(randn(shape, seed=2)), _class_targets(shape)]


# The losses share one reduction path: every split on the layouts that differ most, the skewed
# split (an empty shard, uneven rows) alone on the others.
SPLITS = {layout: list(SHAPES) if layout in ("2", "3", "2x2") else ["skewed"] for layout in LAYOUTS}


def _check(layout: str, family: str) -> list[str]:
    combos = {}
    for split in SPLITS[layout]:
        shape = SHAPES[split]
        mesh, placements, sizes = sharding(layout, split, shape)
        inputs = _inputs(shape)
        layouts = [placements] * 3 + [_target_placements(placements)]
        for name, fn in FAMILIES[family].items():
            combos[f"{name} on {layout} ({split})"] = _case(fn, inputs, mesh, layouts, [sizes] * 4)
    return run_combos(combos)


def _case(fn: Callable, inputs: list, mesh, layouts: list, sizes: list) -> Callable[[], None]:
    return lambda: assert_sharded_matches(fn, inputs, mesh, layouts, sharding_sizes=sizes)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_matches_single_device(layout: str, family: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout, family)[0]
    assert len(checked) == len(SPLITS[layout]) * len(FAMILIES[family])


# ----- targets split otherwise, parameters, other ranks ------------------------------------------------
class _WeightedLosses(torch.nn.Module):
    """Losses whose weights are parameters: their gradients must be summed over the grid once."""

    def __init__(self) -> None:
        super().__init__()
        self.class_weight = torch.nn.Parameter(_fixed(3))
        self.point_weight = torch.nn.Parameter(_fixed(5))  # over W

    def forward(self, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        soft = F.cross_entropy(x, p, weight=self.class_weight)
        return soft + F.huber_loss(x, p, weight=self.point_weight.expand(x.shape))


def _other_splits() -> list[str]:
    shape = (2, 3, 7, 5)
    mesh = get_mesh((3,))
    x, _, p, t = _inputs(shape)
    skewed = {0: [3, 0, 4]}

    def case(fn: Callable, inputs: list, layouts: list, sizes: list) -> Callable[[], None]:
        return lambda: assert_sharded_matches(fn, inputs, mesh, layouts, sharding_sizes=sizes)

    def ce(x, t):
        return F.cross_entropy(x, t, weight=_fixed(3), label_smoothing=0.2)

    return run_combos({
        "class targets split evenly, input skewed": case(ce, [x, t], [[Shard(2)], [Shard(1)]], [skewed, None]),
        "class targets split over W, input over H": case(ce, [x, t], [[Shard(2)], [Shard(2)]], [skewed, None]),
        "class targets replicated": case(ce, [x, t], [[Shard(2)], [Replicate()]], [skewed, None]),
        "class targets plain": case(ce, [x, t], [[Shard(2)], None], [skewed, None]),
        "probabilities split otherwise": case(F.cross_entropy, [x, p], [[Shard(2)], [Shard(3)]], [skewed, None]),
        "probabilities plain": case(F.cross_entropy, [x, p], [[Shard(2)], None], [skewed, None]),
        "mse_loss target split otherwise": case(F.mse_loss, [x, p], [[Shard(2)], [Shard(3)]], [skewed, None]),
        "(N, C) scores, (N,) targets": case(
            ce, [randn((7, 3)), _class_targets((7, 3))], [[Shard(0)], [Shard(0)]], [skewed, skewed]
        ),
        "(N, C, D, H, W) scores": case(
            ce, [randn((2, 3, 2, 7, 5)), _class_targets((2, 3, 2, 7, 5))], [[Shard(3)], [Shard(2)]], [skewed, skewed]
        ),
        "every target ignored (nan, as torch)": case(
            F.cross_entropy, [x, torch.full(t.shape, _IGNORED)], [[Shard(2)], [Shard(1)]], [skewed, skewed]
        ),
        "weights as parameters": case(_WeightedLosses(), [x, p], [[Shard(2)], [Shard(2)]], [skewed, skewed]),
    })


def test_targets_split_otherwise_and_weight_parameters() -> None:
    assert len(run_on_ranks(3, _other_splits)[0]) == 11


def _errors() -> None:
    mesh = get_mesh((2,))
    x = distribute_tensor(randn((2, 4, 6, 5)), mesh, [Shard(2)])
    y = distribute_tensor(randn((2, 4, 6, 5), seed=1), mesh, [Shard(2)])
    t = distribute_tensor(_class_targets((2, 4, 6, 5)), mesh, [Shard(1)])
    with pytest.raises(ShardedOpError, match="class dim 1 is sharded"):
        F.cross_entropy(distribute_tensor(randn((2, 4, 6, 5)), mesh, [Shard(1)]), t)
    with pytest.raises(ValueError, match="neither as class indices"):
        F.nll_loss(x, t[:, :3])
    for call in (lambda: F.huber_loss(x, y, reduction="avg"), lambda: F.cross_entropy(x, t, reduction="avg")):
        with pytest.raises(ValueError, match="avg is not a valid value for reduction"):  # torch's own check
            call()
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'target'"):
        F.soft_margin_loss(x, y.requires_grad_())


def test_unsupported_layouts_and_bad_arguments_raise_clearly() -> None:
    run_on_ranks(2, _errors)
