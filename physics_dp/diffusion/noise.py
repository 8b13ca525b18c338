"""Layout-independent random numbers: a pure function of (seed, global sample index, global position).

Sharded diffusion must draw exactly the noise one device would, whatever the split, and every
domain rank of a sample must agree without communicating.  A stateful generator cannot give that
(its stream position depends on how much was drawn before), so each value is computed from a
counter: the splitmix64 output function applied to ``key(seed, stream, sample) + position * gamma``
(Steele, Lea & Flood 2014).  Each rank evaluates it only on its own slab's global positions, so it
draws exactly its slab's numbers, in one vectorised pass, on any device, with no per-row generators.
The two 32-bit halves of each hash feed a Box-Muller transform (float64, then cast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..distributed.seeds import GAMMA, MASK64, MUL1, MUL2, derive_seed, mix64
from ..shard_tensor import ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import from_local_with_spec
from ..shard_tensor.spec import dense_order, inverse_order

__all__ = ["derive_seed", "randn_like_global", "sample_sigma_lognormal"]

# Stream tags: the same user seed gives independent numbers for each use.
_FIELD_STREAM = 1
_SIGMA_STREAM = 2


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores (two's complement)."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function, in place on int64 bit patterns (products wrap modulo 2**64).

    torch's ``>>`` is arithmetic, so each shift is masked to make it logical.
    """
    shifted = torch.empty_like(z)
    for bits, multiplier in ((30, _signed(MUL1)), (27, _signed(MUL2)), (31, None)):
        torch.bitwise_right_shift(z, bits, out=shifted)
        shifted &= (1 << (64 - bits)) - 1
        z ^= shifted
        if multiplier is not None:
            z *= multiplier
    return z


def _normal(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Standard normals (float64) at ``positions`` of the streams ``keys`` (broadcast together).

    One 64-bit hash per value: its high half gives u1 in (0, 1) (so log stays finite; tails reach
    6.7 sigma), its low half the angle.
    """
    z = _mix_(positions * _signed(GAMMA) + keys)
    angle = (z & 0xFFFFFFFF).to(torch.float64).mul_(2.0 * math.pi * 2.0**-32).cos_()
    radius = ((z >> 32) & 0xFFFFFFFF).to(torch.float64).add_(0.5).mul_(2.0**-32).log_().mul_(-2.0).sqrt_()
    return radius.mul_(angle)


def _stream_keys(seed: int, stream: int, sample_ids: Sequence[int]) -> list[int]:
    return [_signed(mix64(derive_seed(seed, stream, i))) for i in sample_ids]


def _as_ids(sample_ids: Sequence[int] | torch.Tensor, count: int | None) -> list[int]:
    """Sample ids as Python ints, checked against the batch size ``count`` when one is given."""
    if isinstance(sample_ids, torch.Tensor):
        if sample_ids.ndim != 1 or sample_ids.is_floating_point() or sample_ids.is_complex():
            raise ValueError(
                f"sample_ids must be a 1-D integer tensor, got {sample_ids.dtype} of shape {tuple(sample_ids.shape)}"
            )
        ids = [int(i) for i in sample_ids.tolist()]
    else:
        ids = [int(i) for i in sample_ids]
    if count is not None and len(ids) != count:
        raise ValueError(
            f"got {len(ids)} sample_ids for a batch of {count} samples: pass the global index of every sample "
            "along dim 0 (data-parallel ranks pass the indices of their own samples)"
        )
    return ids


def randn_like_global(like: torch.Tensor, seed: int, sample_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Standard normal noise shaped and laid out like ``like`` ((N, C, ...), plain or ShardTensor).

    Entry ``[n, c, *x]`` depends only on ``(seed, sample_ids[n], c, *x)`` and the global shape, so
    any split (uneven, over several mesh axes, batch sharded) yields the single-device numbers.
    ``sample_ids`` holds the global sample index of each of the ``like.shape[0]`` samples.
    """
    if like.ndim < 2:
        raise ValueError(f"like must be (N, C, ...) with at least 2 dims, got shape {tuple(like.shape)}")
    if not like.is_floating_point():
        raise TypeError(f"randn_like_global needs a floating-point like, got {like.dtype}")
    global_shape = tuple(like.shape)
    if isinstance(like, ShardTensor):
        spec = like._spec
        if spec.has_partial:
            raise ValueError(
                f"like has Partial placements {spec.placements}: noise has no partial-sum layout; "
                "redistribute like to Shard/Replicate first"
            )
        local_shape, offsets = tuple(spec.local_shape()), spec.offsets()
        order = dense_order(spec.shape, spec.stride) or list(range(like.ndim))  # the layout every rank agrees on
    else:
        local_shape, offsets = global_shape, (0,) * like.ndim
        order = dense_order(like.shape, like.stride()) or list(range(like.ndim))
    ids = _as_ids(sample_ids, global_shape[0])[offsets[0] : offsets[0] + local_shape[0]]
    device = like.device

    def laid_out(dim: int, extent: int) -> list[int]:
        """A broadcast shape with ``extent`` at ``dim``, its dims in memory order: the values come out
        in ``like``'s layout, with no copy."""
        shape = [1] * like.ndim
        shape[order.index(dim)] = extent
        return shape

    keys = torch.tensor(_stream_keys(seed, _FIELD_STREAM, ids), dtype=torch.int64, device=device).view(laid_out(0, -1))

    # Global flat position within a sample (row-major, whatever the layout), from broadcast aranges over this slab only.
    positions = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in range(like.ndim - 1, 0, -1):
        index = torch.arange(offsets[dim], offsets[dim] + local_shape[dim], dtype=torch.int64, device=device)
        positions = positions + (index * stride).view(laid_out(dim, local_shape[dim]))
        stride *= global_shape[dim]
    local = _normal(keys, positions).to(like.dtype).permute(inverse_order(order))

    if not isinstance(like, ShardTensor):
        return local
    # like's split, known on every rank: no communication (from_local with explicit sizes would check them)
    return from_local_with_spec(local, ShardTensorSpec(spec.mesh, spec.placements, global_shape, spec.axis_sizes).in_order(order))


def sample_sigma_lognormal(
    seed: int,
    sample_ids: Sequence[int] | torch.Tensor,
    p_mean: float,
    p_std: float,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(N,) noise levels ``exp(p_mean + p_std * n)``, one per sample, from a stream apart from the field noise."""
    ids = _as_ids(sample_ids, None)
    keys = torch.tensor(_stream_keys(seed, _SIGMA_STREAM, ids), dtype=torch.int64, device=device)
    normal = _normal(keys, torch.zeros_like(keys))
    return torch.exp(p_mean + p_std * normal).to(dtype)
