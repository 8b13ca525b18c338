"""SlabShapes: the output split of a resizing op from meta runs, remembered, and None where it cannot know."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.shard_tensor import slab_shapes
from physics_dp.testing import get_mesh, run_on_ranks


def _shapes_for(op, x, *rest):
    flat, tree = pytree.tree_flatten((x, *rest))
    return slab_shapes.SlabShapes(op, flat, tree, [x._spec], {}, usable=True)


def _extents_and_reruns() -> dict:
    mesh = get_mesh((3,))
    x = distribute_tensor(torch.randn(1, 8, 14, 4), mesh, [Shard(2)], {0: [4, 6, 4]})
    found = {"shuffle": _shapes_for(torch.ops.aten.pixel_shuffle.default, x, 2).extents(0, (), 2)}
    runs = []
    original = slab_shapes.SlabShapes._run_on_meta
    slab_shapes.SlabShapes._run_on_meta = lambda self, coordinate: runs.append(coordinate) or original(self, coordinate)
    try:
        found["again"] = _shapes_for(torch.ops.aten.pixel_shuffle.default, x, 2).extents(0, (), 2)
        found["runs_when_remembered"] = len(runs)
        found["other_factor"] = _shapes_for(torch.ops.aten.pixel_unshuffle.default, x, 2).extents(0, (), 2)
        found["runs_for_a_new_call"] = len(runs)
    finally:
        slab_shapes.SlabShapes._run_on_meta = original
    found["data_dependent"] = _shapes_for(torch.ops.aten.nonzero.default, x).extents(0, (), 0)
    unusable = slab_shapes.SlabShapes(torch.ops.aten.pixel_shuffle.default, [x, 2], None, [x._spec], {}, usable=False)
    found["not_usable"] = unusable.extents(0, (), 2)
    return found


def test_extents_come_from_meta_runs_and_are_remembered_per_call() -> None:
    for found in run_on_ranks(3, _extents_and_reruns):
        assert found["shuffle"] == (8, 12, 8)
        assert found["again"] == (8, 12, 8) and found["runs_when_remembered"] == 0
        assert found["other_factor"] == (2, 3, 2) and found["runs_for_a_new_call"] == 3  # one meta run per coordinate
        assert found["data_dependent"] is None  # nonzero's row count depends on the values: the fallback gathers
        assert found["not_usable"] is None
