"""Random ops on sharded tensors: each slab draws its own numbers, and every rank's generator advances alike.

Ranks of a job are usually seeded alike, so that they initialize and decide alike.  Run on the
slabs with each rank's own default generator, a random op (``F.dropout``, ``torch.randn_like``,
``x.normal_()``, ``torch.bernoulli``) gave every slab the *same* numbers: one dropout mask or
noise field repeated slab after slab.  On uneven splits the ranks also drew different amounts,
so their generators parted, and a later draw meant to agree across ranks (a random sample index,
a noise level) silently differed.

Here such an op draws one key from the generator it was given (the default CPU generator
otherwise), the same number on every rank in step; the slab's numbers come from a generator
seeded with (key, the rank's coordinates along the mesh axes that shard the tensor).  Slabs are
independent, ranks that hold the same slab (replicated axes) draw the same numbers, a seed gives
the same result every run, and the default generators stay in step whatever the split.  The
numbers are not those one device would draw (a sequential generator cannot be split); for noise
that is, whatever the layout, see :func:`physics_dp.diffusion.randn_like_global`.

Layouts that need no communication (a one-rank mesh) keep torch's own draw, equal to plain torch.
Under ``torch.compile`` these ops keep the slab-wise draw of the default generator (the compiler
draws its own numbers per graph; a traced graph cannot draw the key).
"""

from __future__ import annotations

import torch

from ..distributed.seeds import derive_seed
from ..distributed.tracing import is_tracing
from ..shard_tensor import ShardTensor
from ..shard_tensor.fallback import propagate_and_run
from ..shard_tensor.dispatch import register_strided_handler
from ..shard_tensor.placements import SHARDING_PLACEMENTS
from ._local import ShardedOpError

__all__: list[str] = []

aten = torch.ops.aten

# Elementwise random ops with a ``generator`` argument; the first tensor argument sets the layout.
_SEEDED = (
    aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.bernoulli.default, aten.bernoulli.p,
    aten.normal_.default, aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor,
    aten.uniform_.default, aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
    aten.exponential_.default, aten.geometric_.default, aten.cauchy_.default, aten.log_normal_.default,
    aten.randn_like.generator, aten.rand_like.generator, aten.randint_like.generator,
    aten.randint_like.Tensor_generator, aten.randint_like.low_generator_dtype,
    aten.poisson.default, aten.binomial.default, aten._standard_gamma.default,
)
# The same draws without a generator argument: their overloads that take one.
_WITH_GENERATOR = {
    aten.randn_like.default: aten.randn_like.generator,
    aten.rand_like.default: aten.rand_like.generator,
    aten.randint_like.default: aten.randint_like.generator,
    aten.randint_like.Tensor: aten.randint_like.Tensor_generator,
    aten.randint_like.low_dtype: aten.randint_like.low_generator_dtype,
}
_KEY_RANGE = 1 << 62
_slab_generators: dict[torch.device, torch.Generator] = {}


def _slab_generator(layout: ShardTensor, generator: torch.Generator | None) -> torch.Generator:
    """A generator for this rank's slab, seeded with a key drawn alike on every rank and the
    rank's coordinates along the axes that shard ``layout``."""
    key = int(torch.randint(_KEY_RANGE, (1,), generator=generator, device=generator.device if generator else "cpu"))
    spec = layout._spec
    coordinate = spec.mesh.get_coordinate() or []
    # strided dims (tokens of a 2-D decomposition) hold different data on each rank too
    keys = [axis << 32 | coordinate[axis] for axis, p in enumerate(spec.placements) if type(p) in SHARDING_PLACEMENTS]
    device = layout._local_tensor.device
    slab_generator = _slab_generators.get(device)
    if slab_generator is None:
        slab_generator = _slab_generators[device] = torch.Generator(device=device)
    return slab_generator.manual_seed(derive_seed(key, *keys))


def _random_on_slabs(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> torch.Tensor:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    layout = tensors[0]
    if is_tracing() or not isinstance(layout, ShardTensor) or any(
        isinstance(t, ShardTensor) and t._spec != layout._spec or not isinstance(t, ShardTensor) and t.ndim for t in tensors
    ):
        return propagate_and_run(op, args, kwargs)  # operands in several layouts: DTensor's rules line them up first
    if layout._spec.has_partial:
        raise ShardedOpError(str(op), [layout], "a random draw on a pending sum: redistribute it to Replicate first")
    op = _WITH_GENERATOR.get(op, op)
    generator = _slab_generator(layout, kwargs.get("generator"))
    local_args = [a._local_tensor if isinstance(a, ShardTensor) else a for a in args]
    result = op(*local_args, **{**kwargs, "generator": generator})
    if result is layout._local_tensor:  # in place
        return layout
    return ShardTensor(result, layout._spec)


def _native_dropout(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused dropout (CUDA's training path; CPU's composes ``bernoulli_``): torch's result,
    the kept values scaled by 1 / (1 - p), with the mask drawn from the slab's generator."""
    x, p, train = args
    if is_tracing():
        return propagate_and_run(op, args, kwargs)
    slab = x._local_tensor
    if train is False:
        mask = torch.ones_like(slab, dtype=torch.bool)
        return ShardTensor(slab.clone(), x._spec), ShardTensor(mask, x._spec)
    mask = torch.empty_like(slab, dtype=torch.bool).bernoulli_(1 - p, generator=_slab_generator(x, None))
    scale = 0.0 if p == 1 else 1 / (1 - p)
    return ShardTensor(slab * mask * scale, x._spec), ShardTensor(mask, x._spec)


# Strided layouts too: an elementwise draw keeps the layout, and the slabs must still differ.
for _op, _handler in [*((op, _random_on_slabs) for op in (*_SEEDED, *_WITH_GENERATOR)), (aten.native_dropout.default, _native_dropout)]:
    ShardTensor.register_dispatch_handler(_op, _handler)
    register_strided_handler(_op, _handler)
