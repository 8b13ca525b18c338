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
