"""In-place view ops (squeeze_, unsqueeze_, transpose_, t_, swapdims_) and ``x.data = y`` keep slab,
spec and wrapper in step.

Before ``inplace_views.py`` they ran on the slab alone: the wrapper and its spec kept the old
shape over a slab of the new one (on one-rank meshes and replicated tensors silently), and
``torch.quantile``, which ends in a ``squeeze_``, failed in backward on every sharded layout.
``x.data = y`` changed only the wrapper: ``x`` went on computing with its old slab.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops._local import ShardedOpError
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

from .test_shape_ops import LAYOUTS, check_family, randn, world_of

FAMILY: dict[str, Callable] = {
    "unsqueeze_(0)": lambda x: x.clone().unsqueeze_(0) * 2,
    "unsqueeze_(-1), then a sum over H": lambda x: x.clone().unsqueeze_(-1).sum(2),
    "transpose_(2, 3)": lambda x: x.clone().transpose_(2, 3) * 2,
    "transpose_(0, 2)": lambda x: x.clone().transpose_(0, 2) * 2,
    "swapdims_(1, 2)": lambda x: x.clone().swapdims_(1, 2) * 2,
    "squeeze_(3) of a kept sum": lambda x: x.sum(3, keepdim=True).squeeze_(3) * 2,
    "squeeze_() of a kept sum": lambda x: x.sum(3, keepdim=True).squeeze_() * 2,
    "squeeze_((1, 3)) of a kept sum": lambda x: x.sum((1, 3), keepdim=True).squeeze_((1, 3)) * 2,
    "t_() of a plane": lambda x: x[0, 0].clone().t_() * 2,
    "a write through a view of the transposed tensor": lambda x: _through_view(x),
    "x.data = y, then x used": lambda x: _data_assigned(x),
    "quantile over H": lambda x: torch.quantile(x, 0.3, dim=2),
    "quantile over H and W, two q": lambda x: torch.quantile(x.flatten(2), torch.tensor([0.2, 0.7]), dim=2),
    "quantile of all": lambda x: torch.quantile(x, 0.5),
    "nanquantile over W": lambda x: torch.nanquantile(x, 0.3, dim=3, keepdim=True),
}


def _through_view(x: torch.Tensor) -> torch.Tensor:
    """A write through a view of the transposed tensor lands in it, and its gradient too."""
    y = x.clone().transpose_(2, 3)
    y[:, :, 0].mul_(3)
    return y


def _data_assigned(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y.data = (x * 3).data
    return y + x


def _check(layout: str) -> list[str]:
    return check_family(layout, FAMILY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_inplace_views_match_single_device(layout: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout)[0]
    assert len(checked) == 3 * len(FAMILY)


def _metadata_moves_together(world: int) -> None:
    """Wrapper, spec and slab agree after each op, on a sharded and a replicated tensor; nothing is sent."""
    mesh = get_mesh((world,))
    for placements in ([Shard(2)], [Replicate()]):
        x = distribute_tensor(randn((2, 3, 7, 5)), mesh, placements)
        with count_communication() as log:
            y = x.clone().unsqueeze_(0).transpose_(3, 4).squeeze_(0)
        assert tuple(y.shape) == (2, 3, 5, 7) == tuple(y._spec.shape)
        assert y._spec.local_shape() == tuple(y._local_tensor.shape)
        assert y.stride() == y._spec.stride
        assert log.kinds() == [], log.kinds()
        torch.testing.assert_close(y.full_tensor(), randn((2, 3, 7, 5)).transpose(2, 3))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_metadata_moves_together(world: int) -> None:
    run_on_ranks(world, _metadata_moves_together, world)


def _plain_data_raises() -> None:
    """A plain tensor could be the global value or the slab: refused, naming both ways to say which."""
    x = distribute_tensor(torch.zeros(2, 4), get_mesh((2,)), [Shard(1)])
    with pytest.raises(TypeError, match="distribute_tensor"):
        x.data = torch.ones(2, 4)


def test_plain_data_raises() -> None:
    run_on_ranks(2, _plain_data_raises)


def _squeezing_a_split_dim_raises() -> None:
    """A size-1 dim split over ranks squeezes only by moving data: refused, naming the out-of-place op."""
    x = distribute_tensor(torch.zeros(2, 1, 4), get_mesh((2,)), [Shard(1)])
    with pytest.raises(ShardedOpError, match="use the out-of-place op"):
        x.squeeze_(1)


def test_squeezing_a_split_dim_raises() -> None:
    run_on_ranks(2, _squeezing_a_split_dim_raises)
