"""ShardTensorSpec: default splits, validation messages, per-rank shapes and offsets."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from physics_dp.shard_tensor import ShardTensorSpec, balanced_sizes
from physics_dp.shard_tensor.spec import chunk_sizes
from physics_dp.testing import get_mesh, run_on_ranks


@pytest.mark.parametrize(
    "extent,parts,balanced,chunk",
    [(6, 4, (2, 2, 1, 1), (2, 2, 2, 0)), (7, 3, (3, 2, 2), (3, 3, 1)), (2, 4, (1, 1, 0, 0), (1, 1, 0, 0)), (8, 4, (2,) * 4, (2,) * 4), (0, 2, (0, 0), (0, 0))],
)
def test_default_and_chunk_splits(extent, parts, balanced, chunk):
    assert balanced_sizes(extent, parts) == balanced
    assert balanced == tuple(len(p) for p in torch.tensor_split(torch.arange(extent), parts))
    assert chunk_sizes(extent, parts) == chunk


def _validation_errors():
    mesh = get_mesh((2, 2))
    errors = {}
    bad = {
        "count": ([Shard(0)], (4, 4), None),
        "range": ([Shard(2), Replicate()], (4, 4), None),
        "nested": ([Shard(0), Shard(0)], (4, 4), None),
        "unknown": ([_StridedShard(0, split_factor=2), Replicate()], (4, 4), None),
        "sizes": ([Shard(0), Replicate()], (4, 4), [(3, 2), None]),
        "partial_op": ([Partial("prod"), Replicate()], (4, 4), None),
    }
    for name, (placements, shape, sizes) in bad.items():
        with pytest.raises(ValueError) as info:
            ShardTensorSpec(mesh, placements, shape, sizes)
        errors[name] = str(info.value)
    return errors


def test_invalid_specs_name_the_problem():
    errors = run_on_ranks(4, _validation_errors)[0]
    assert "one placement per mesh axis" in errors["count"]
    assert "out of range" in errors["range"]
    assert "over two mesh axes" in errors["nested"]
    assert "unsupported placement" in errors["unknown"]
    assert "do not split dim 0 of extent 4" in errors["sizes"]
    assert "Partial('prod')" in errors["partial_op"]


def _shapes_and_offsets():
    mesh = get_mesh((2, 2))
    spec = ShardTensorSpec(mesh, [Shard(2), Shard(3)], (1, 3, 7, 5), [(4, 3), (1, 4)])
    coordinate = mesh.get_coordinate()
    return coordinate, tuple(spec.local_shape()), spec.offsets(), {a: [tuple(s) for s in v] for a, v in spec.sharding_shapes().items()}


def test_local_shapes_offsets_and_sharding_shapes_on_2x2():
    for coordinate, local, offsets, shapes in run_on_ranks(4, _shapes_and_offsets):
        i, j = coordinate
        assert local == (1, 3, (4, 3)[i], (1, 4)[j])
        assert offsets == (0, 0, (0, 4)[i], (0, 1)[j])
        assert shapes[0] == [(1, 3, 4, (1, 4)[j]), (1, 3, 3, (1, 4)[j])]
        assert shapes[1] == [(1, 3, (4, 3)[i], 1), (1, 3, (4, 3)[i], 4)]


def _pickled_specs_come_back_whole() -> list[tuple[bool, int]]:
    import pickle

    from physics_dp.shard_tensor.placements import StridedShard

    mesh = get_mesh((2,))
    specs = [
        ShardTensorSpec(mesh, [Shard(1)], (4, 7), [(3, 4)]),
        ShardTensorSpec(mesh, [Partial()], (4, 7)),
        ShardTensorSpec(mesh, [StridedShard(0, (2, 3), 1)], (6, 5), [(1, 2)]),
        ShardTensorSpec(mesh, [Replicate()], (3, 2), stride=(1, 3)),
    ]
    original_init, inits = ShardTensorSpec.__init__, []

    def counting_init(self, *args, **kwargs):
        inits.append(1)
        original_init(self, *args, **kwargs)

    results = []
    ShardTensorSpec.__init__ = counting_init
    try:
        for spec in specs:
            inits.clear()
            again = pickle.loads(pickle.dumps(spec))
            fields = ("placements", "shape", "stride", "axis_sizes", "has_partial", "local_only", "strided")
            results.append((again == spec and all(getattr(again, f) == getattr(spec, f) for f in fields), len(inits)))
    finally:
        ShardTensorSpec.__init__ = original_init
    return results


def test_unpickling_runs_init_so_derived_fields_follow_the_code():
    """torch.compile's disk caches pickle specs; one pickled by an older version must not lack new fields."""
    for results in run_on_ranks(2, _pickled_specs_come_back_whole):
        assert results == [(True, 1)] * 4


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 8, 1, 6), (2, 1, 3, 3), (1, 4, 2, 3, 5)])
def test_dense_layout_helpers_agree_with_torch(shape):
    """Strides of a permuted dense layout, its order, and the layout checks, against torch's own."""
    from physics_dp.shard_tensor.spec import (
        CHANNELS_LAST_ORDERS, channels_last_order, dense_order, in_memory_order, inverse_order, strides_in_order,
    )

    order = CHANNELS_LAST_ORDERS[len(shape)]
    memory_format = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    t = torch.empty(shape, memory_format=memory_format)
    assert strides_in_order(shape, order) == t.stride()
    assert strides_in_order(shape, range(len(shape))) == torch.empty(shape).stride()
    assert dense_order(shape, t.stride()) is not None
    assert dense_order(shape, torch.empty(shape).expand(*shape).stride()) is not None
    assert dense_order((2, 3), (0, 1)) is None  # an expanded dim: no dense order
    # torch's question: channels last and not also row-major (one channel, or one pixel, is row-major)
    expected = t.is_contiguous(memory_format=memory_format) and not t.is_contiguous()
    assert (channels_last_order(t) is not None) == expected
    permuted = torch.randn(shape)
    again = in_memory_order(permuted, order)
    assert torch.equal(again, permuted) and again.permute(order).is_contiguous()
    assert in_memory_order(again, order).data_ptr() == again.data_ptr()  # already so: no copy
    assert list(permuted.permute(order).permute(inverse_order(order)).shape) == list(shape)


def _spec_layouts():
    from physics_dp.shard_tensor.spec import CHANNELS_LAST_ORDERS, in_spec_order, laid_out_as

    mesh = get_mesh((2,))
    row_major = ShardTensorSpec(mesh, [Shard(2)], (2, 3, 8, 5))
    channels_last = row_major.in_order(CHANNELS_LAST_ORDERS[4])
    one_channel = ShardTensorSpec(mesh, [Shard(2)], (2, 1, 8, 5)).in_order(CHANNELS_LAST_ORDERS[4])
    local = torch.randn(row_major.local_shape())
    laid = in_spec_order(local, channels_last)
    return {
        "same spec object per order": channels_last is row_major.in_order(CHANNELS_LAST_ORDERS[4]),
        "identity order is row-major": row_major.in_order(range(4)) is row_major,
        "flags": (row_major.is_channels_last(), channels_last.is_channels_last(), one_channel.is_channels_last()),
        "values kept": torch.equal(laid, local),
        "laid out": (laid_out_as(local, channels_last), laid_out_as(laid, channels_last), laid_out_as(local, row_major)),
        "no second copy": in_spec_order(laid, channels_last).data_ptr() == laid.data_ptr(),
    }


def test_specs_lay_slabs_out_channels_last():
    result = run_on_ranks(2, _spec_layouts)[0]
    assert result["same spec object per order"] and result["identity order is row-major"]
    assert result["flags"] == (False, True, False)
    assert result["values kept"] and result["laid out"] == (False, True, True) and result["no second copy"]
