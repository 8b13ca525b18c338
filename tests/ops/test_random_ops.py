"""Random ops on sharded tensors: independent slabs, reproducible draws, generators kept in step.

Before ``random_ops.py``, ranks seeded alike drew the same numbers on every slab (one dropout mask
or noise field repeated slab after slab), and on uneven splits their default generators parted.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

DRAWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "randn_like": torch.randn_like,
    "rand_like": torch.rand_like,
    "randint_like": lambda x: torch.randint_like(x, 1000),
    "F.dropout": lambda x: F.dropout(x, 0.5, training=True),
    "fused dropout": lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0],
    "normal_": lambda x: x.clone().normal_(),
    "uniform_": lambda x: x.clone().uniform_(),
    "bernoulli": lambda x: torch.bernoulli(x * 0.5),
    "normal(mean)": lambda x: torch.normal(x, 1.0),
    "exponential_": lambda x: x.clone().exponential_(),
}
SHAPE = (2, 3, 8, 6)


def _draws(world: int, sizes: dict | None, mesh_shape: tuple[int, ...], placements: list) -> dict:
    """Per draw: this rank's slab, the global value twice from one seed, and the next default draw."""
    x = distribute_tensor(torch.ones(SHAPE), get_mesh(mesh_shape), placements, sizes)
    found = {}
    for name, draw in DRAWS.items():
        torch.manual_seed(7)
        first = draw(x)
        after = torch.rand(4)
        torch.manual_seed(7)
        again = draw(x)
        found[name] = (first._local_tensor.clone(), first.full_tensor(), again.full_tensor(), after)
    return found


@pytest.mark.parametrize(
    "world, sizes", [(2, None), (2, {0: [3, 5]}), (3, {0: [3, 0, 5]})], ids=["2 even", "2 uneven", "3 with an empty shard"]
)
def test_slabs_draw_independently_and_generators_stay_in_step(world: int, sizes: dict | None) -> None:
    ranks = run_on_ranks(world, _draws, world, sizes, (world,), [Shard(2)])
    for name in DRAWS:
        slabs, full, again, after = zip(*(rank[name] for rank in ranks))
        for rank in range(1, world):
            assert torch.equal(full[0], full[rank]), f"{name}: ranks disagree on the global value"
            assert torch.equal(after[0], after[rank]), f"{name}: the default generators parted"
        assert torch.equal(full[0], again[0]), f"{name}: one seed gave two results"
        rows = full[0].unbind(2)
        assert not any(torch.equal(rows[0], row) for row in rows[1:]), f"{name}: a row repeats"
        nonempty = [s for s in slabs if s.numel()]
        if len(nonempty) > 1 and nonempty[0].shape == nonempty[1].shape:
            assert not torch.equal(nonempty[0], nonempty[1]), f"{name}: two slabs drew the same numbers"


def test_replicated_axes_draw_alike() -> None:
    """On a (data, domain) mesh with the batch replicated, the two data ranks of a slab draw its numbers alike."""
    ranks = run_on_ranks(4, _draws, 4, None, (2, 2), [Replicate(), Shard(2)])
    for name in DRAWS:
        slabs = [rank[name][0] for rank in ranks]
        assert torch.equal(slabs[0], slabs[2]) and torch.equal(slabs[1], slabs[3]), name
        assert not torch.equal(slabs[0], slabs[1]), name


def _token_slabs() -> dict[str, torch.Tensor]:
    """Each draw's slab on tokens flattened from a 2 x 2 decomposition (strided dims)."""
    x = distribute_tensor(torch.ones(SHAPE), get_mesh((2, 2)), [Shard(2), Shard(3)]).flatten(2)
    torch.manual_seed(7)
    drawn = {name: draw(x) for name, draw in DRAWS.items()}
    assert all(y.placements == x.placements for y in drawn.values()), "a draw changed the tokens' layout"
    return {name: y._local_tensor.clone() for name, y in drawn.items()}


def test_strided_token_slabs_draw_independently() -> None:
    ranks = run_on_ranks(4, _token_slabs)
    for name in DRAWS:
        slabs = [rank[name] for rank in ranks]
        assert all(not torch.equal(slabs[0], slab) for slab in slabs[1:]), f"{name}: two token slabs drew the same numbers"


def _channel_dropout() -> torch.Tensor:
    x = distribute_tensor(torch.ones(2, 8, 6, 4), get_mesh((2,)), [Shard(2)], {0: [2, 4]})
    torch.manual_seed(3)
    return F.dropout2d(x, 0.5, training=True).full_tensor()


def test_channel_dropout_drops_whole_channels() -> None:
    out = run_on_ranks(2, _channel_dropout)[0]
    per_channel = out.flatten(2)
    assert torch.equal(per_channel.amin(2), per_channel.amax(2)), "a channel was dropped on some rows only"
    assert 0 < (per_channel[..., 0] == 0).sum() < per_channel.shape[0] * per_channel.shape[1]


def _one_rank_is_torch() -> bool:
    x = distribute_tensor(torch.ones(SHAPE), get_mesh((1,)), [Shard(2)])
    for name, draw in DRAWS.items():
        torch.manual_seed(5)
        sharded = draw(x).full_tensor()
        torch.manual_seed(5)
        assert torch.equal(sharded, draw(torch.ones(SHAPE))), name
    return True


def test_a_one_rank_mesh_draws_what_torch_draws() -> None:
    assert run_on_ranks(1, _one_rank_is_torch)[0]
