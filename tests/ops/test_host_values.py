"""``torch.equal``, ``torch.allclose`` and ``Tensor.tolist`` answer for the global tensor, the same on every rank.

Before ``host_values.py``: ``torch.equal`` failed on every layout (its aten op is tagged
pointwise, so each rank compared its own slab and the wrapper then choked on the bool),
``allclose`` over a sharded dim raised (no DTensor rule), and ``tolist`` / ``numpy`` raised
torch's "not supported for tensor subclasses".
"""

from __future__ import annotations

import pytest
import torch

from physics_dp.shard_tensor import distribute_tensor
from physics_dp.testing import run_on_ranks

from .test_shape_ops import LAYOUTS, randn, sharding, world_of


def _answers(layout: str) -> list:
    """Per split: the answers of a sharded pair against those of the global pair, on this rank."""
    found = []
    for split, shape in (("even", (2, 3, 8, 8)), ("skewed", (2, 3, 7, 5))):
        mesh, placements, sizes = sharding(layout, split, shape)
        a = randn(shape)
        b = a.clone()
        b[1, 2, -1, -1] += 1e-3  # one element apart, on the last rank's slab
        sa, sb = (distribute_tensor(t, mesh, placements, sizes) for t in (a, b))
        for name, sharded, plain in (
            ("equal to itself", torch.equal(sa, sa.clone()), True),
            ("equal to the changed copy", torch.equal(sa, sb), False),
            ("equal, against a plain tensor", sa.equal(a), True),
            ("equal, other shapes", torch.equal(sa, sa[:, :, :2]), False),
            ("allclose", torch.allclose(sa, sb, atol=1e-2), True),
            ("not allclose", torch.allclose(sa, sb), False),
            ("allclose with NaN, equal_nan", torch.allclose(sa / 0 * 0, sa / 0 * 0, equal_nan=True), True),
            ("tolist", sa.tolist(), a.tolist()),
        ):
            assert sharded == plain, f"{name} on {layout} ({split}): {sharded!r} != {plain!r}"
            found.append(name)
    with pytest.raises(TypeError, match="full_tensor"):
        sa.numpy()
    return found


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_host_values_are_the_global_answers(layout: str) -> None:
    answers = run_on_ranks(world_of(layout), _answers, layout)
    assert all(len(found) == 16 for found in answers), answers
