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


def _private_partials():
    mesh = get_mesh((2,))
    x = _spec(mesh, [Shard(1)], (6, 4))
    index = private.make_spec(mesh, (Replicate(),), torch.Size((6, 1)), (1, 1), torch.int64)
    gathered = private.propagate(aten.gather.default, (x, 1, index), {})
    target = [s for s in gathered.redistribute_schema.args_schema if isinstance(s, private.DTensorSpec)]
    facts = {
        "gather_input": tuple(target[0].placements),
        "gather_index": private.mask_partial(target[1].placements[0]),
        "gather_output": private.mask_partial(gathered.output_spec.placements[0]),
    }
    for p in (3, 2.5, 0, float("inf")):
        placement = private.propagate(aten.norm.ScalarOpt_dim, (x, p, [1]), {}).output_spec.placements[0]
        facts[f"norm {p}"] = (private.norm_partial(placement), private.mask_partial(placement), placement.is_partial())
    facts["plain"] = [(private.mask_partial(p), private.norm_partial(p)) for p in (Partial("sum"), Replicate(), Shard(0))]
    return facts


def test_private_partials_we_translate():
    """A replicated index of extent 1 into a sharded gather dim becomes DTensor's ``_MaskPartial``
    (masked lookup, then a sum), the same on the output; a p-norm over a sharded dim is a
    ``_NormPartial(p)`` except for p in {0, inf, -inf}, which are ordinary partials."""
    facts = run_on_ranks(2, _private_partials)[0]
    assert facts["gather_input"] == (Shard(1),)
    assert facts["gather_index"] == facts["gather_output"] == (1, torch.Size((6, 4)))
    assert facts["norm 3"] == (3.0, None, True) and facts["norm 2.5"] == (2.5, None, True)
    assert facts["norm 0"] == (None, None, True) and facts["norm inf"] == (None, None, True)
    assert facts["plain"] == [(None, None)] * 3
