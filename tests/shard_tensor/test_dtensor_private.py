"""Pins the private DTensor behaviour the fallback relies on (see _dtensor_private.py).

If torch is upgraded, these tests say which assumption moved before any result goes wrong.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from physics_dp.shard_tensor import _dtensor_private as private
from physics_dp.shard_tensor.spec import contiguous_strides
from physics_dp.testing import get_mesh, run_on_ranks

aten = torch.ops.aten


def _spec(mesh, placements, shape):
    return private.make_spec(mesh, tuple(placements), torch.Size(shape), contiguous_strides(shape), torch.float32)


def _propagation_facts():
    mesh = get_mesh((2,))
    x = _spec(mesh, [Shard(0)], (6, 4))
    facts = {}
    summed = private.propagate(aten.sum.dim_IntList, (x, [0]), {})
    facts["sum_sharded"] = tuple(summed.output_spec.placements)
    sliced = private.propagate(aten.slice.Tensor, (x, 0, 1, 5), {})
    facts["slice_sharded_needs_redistribute"] = sliced.needs_redistribute
    facts["slice_sharded_input"] = tuple(
        s.placements for s in sliced.redistribute_schema.args_schema if isinstance(s, private.DTensorSpec)
    )
    viewed = private.propagate(aten.view.default, (x, [6, 2, 2]), {})
    facts["view_rewrites_args"] = viewed.use_val_from_redistribute_schema
    facts["view_local_shape"] = list(viewed.redistribute_schema.args_schema[1])
    transposed = private.propagate(aten.t.default, (x,), {})
    facts["t"] = tuple(transposed.output_spec.placements)
    facts["t_meta"] = tuple(transposed.output_spec.tensor_meta.shape)
    return facts


def test_propagator_decisions_we_rely_on():
    facts = run_on_ranks(2, _propagation_facts)[0]
    assert facts["sum_sharded"] == (Partial("sum"),)
    assert facts["slice_sharded_needs_redistribute"] and facts["slice_sharded_input"] == ((Replicate(),),)
    # view arguments are rewritten to the local shape of the torch.chunk layout (hence the
    # fallback moves inputs of such ops to that layout first)
    assert facts["view_rewrites_args"] and facts["view_local_shape"] == [3, 2, 2]
    assert facts["t"] == (Shard(1),) and facts["t_meta"] == (4, 6)


def test_validated_torch_version():
    assert ".".join(torch.__version__.split(".")[:2]) in private.TESTED_TORCH


def _decisions_follow_every_argument():
    mesh = get_mesh((2,))
    x = _spec(mesh, [Shard(0)], (6, 4))
    shapes = {}
    for bins in (6, 4):  # histc registers its static arguments from index 2: bins was not in the key
        shapes[f"histc {bins}"] = tuple(private.propagate(aten.histc.default, (x, bins, 0.0, 1.0), {}).output_spec.tensor_meta.shape)
    for k in (3, 2):  # as topk's k
        values = private.propagate(aten.topk.default, (x, k, 1), {}).output_spec[0]
        shapes[f"topk {k}"] = tuple(values.tensor_meta.shape)
    return shapes


def test_propagation_cache_keys_every_argument():
    """DTensor's cache skips non-tensor arguments before an op's registered ``static_argnum``;
    ``propagate`` hashes them all, so a second call with another ``bins`` or ``k`` is not given
    the first call's output."""
    shapes = run_on_ranks(2, _decisions_follow_every_argument)[0]
    assert shapes == {"histc 6": (6,), "histc 4": (4,), "topk 3": (6, 3), "topk 2": (6, 2)}, shapes
