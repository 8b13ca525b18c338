"""``F.scaled_dot_product_attention`` with the token dim sharded: ring attention and friends.

- q and k/v sharded on the same mesh axis: ring attention.  K/V blocks travel around the ring
  (the next block is in flight while the current one is computed) and per-block results merge
  with a stable log-sum-exp.  The backward runs the ring again: K/V blocks one step ahead of
  their use, as in the forward, and each block's dK/dV sum one step behind, travelling home
  while the next block is computed (2N - 1 messages per rank, the bytes of N).  Memory per rank
  is one block of scores, never the full L x S matrix.
  A double backward (``create_graph``) instead gathers every K/V block (differentiably) and
  differentiates explicit attention over them.
- q sharded, k/v whole on every rank (e.g. cross-attention to a replicated context): local, and
  the k/v gradients are summed over the axis.
- q whole, k/v sharded: each rank attends to its keys; one max, one sum and one weighted-sum
  all-reduce merge the partial results.

Masks (boolean or additive, broadcastable to (..., L, S)) and ``is_causal`` use global token
offsets, so uneven and empty shards are exact.  Works on CPU/gloo (no fused kernels needed).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..distributed.axis_groups import group_over_axes
from ..distributed.tracing import outside_trace
from ..shard_tensor import Replicate, Shard, ShardTensor
from ..shard_tensor.conversions import without_strided_dims
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.placements import StridedShard
from .autocast import lower_precision
from ._local import ShardedOpError, local_input, sum_grad_over_axes, wrap_local
from .grad_sums import creating_graph, sum_replicated
from .halo import gather_window

__all__ = ["RingMeta"]

aten = torch.ops.aten

_OP = "scaled_dot_product_attention"


def _offsets(sizes: tuple[int, ...]) -> list[int]:
    out, running = [], 0
    for s in sizes:
        out.append(running)
        running += s
    return out


@dataclass(frozen=True)
class RingMeta:
    """What every block computation needs: who holds which tokens, and the mask rule."""

    group: ProcessGroup
    me: int
    size: int
    q_offset: int
    kv_sizes: tuple[int, ...]
    scale: float
    causal: bool
    mask: torch.Tensor | None  # global, broadcastable to (..., L, S); additive float

    def kv_offset(self, owner: int) -> int:
        return _offsets(self.kv_sizes)[owner]

    @property
    def previous(self) -> int:
        """The group rank whose blocks this rank receives (it sends to the next one)."""
        return (self.me - 1) % self.size


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _block_bias(meta: RingMeta, rows: int, owner: int, cols: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive bias of the (my queries) x (owner's keys) block, from global offsets."""
    k_offset = meta.kv_offset(owner)
    bias = None
    if meta.mask is not None:
        mask = meta.mask
        if mask.shape[-2] != 1:
            mask = mask.narrow(-2, meta.q_offset, rows)
        if mask.shape[-1] != 1:
            mask = mask.narrow(-1, k_offset, cols)
        bias = mask.to(device=device, dtype=dtype)
    if meta.causal:
        r = torch.arange(meta.q_offset, meta.q_offset + rows, device=device)[:, None]
        c = torch.arange(k_offset, k_offset + cols, device=device)[None, :]
        causal = torch.zeros(rows, cols, dtype=dtype, device=device).masked_fill(c > r, float("-inf"))
        bias = causal if bias is None else bias + causal
    return bias


def _scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores if bias is None else scores + bias


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """-inf (a fully masked row) as 0, so exp(s - lse) stays 0 instead of NaN."""
    return torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)


_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# CUDA: fp32 blocks take the memory-efficient kernel, half-precision blocks the flash kernel.  The
# memory-efficient kernel's bf16/fp16 gradients came out wrong when fed a ring-merged output
# (torch 2.11, H100), so half precision never takes it.
_CUDA_EFFICIENT_DTYPES = (torch.float32,)
_CUDA_FLASH_DTYPES = (torch.bfloat16, torch.float16)


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Which of torch's fused kernels that report the log-sum-exp fits this block, if any: the CPU
    flash kernel; on CUDA (unmasked blocks only, so bias alignment rules never matter) the flash
    kernel for half precision where torch's own checks admit it (GPU generation, head size,
    strides), else the memory-efficient kernel for fp32.  None materializes the score matrix.
    Under ``sdpa_kernel(SDPBackend.MATH)`` (e.g. for a double backward, which the fused CPU kernel
    lacks) the explicit path runs, as torch's own op would.  So does an empty block (a rank with no
    heads or no rows of a 2-D split): the CPU kernel stops the process on a division by zero."""
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1] and q.numel() > 0 and k.numel() > 0):
        return None
    if not q.ndim == k.ndim == v.ndim == 4:  # the kernels take (batch, heads, tokens, head dim) only
        return None
    if q.device.type == "cpu" and q.dtype in _FUSED_DTYPES and torch.backends.cuda.flash_sdp_enabled():
        return "cpu"  # unless the user turned the flash kernel off (sdpa_kernel), as torch's CPU dispatch does
    if q.device.type != "cuda" or bias is not None:
        return None
    if q.dtype in _CUDA_FLASH_DTYPES and torch.backends.cuda.flash_sdp_enabled():
        return "cuda_flash" if _flash_admits(*_unit_last_stride(q, k, v)) else None
    if q.dtype in _CUDA_EFFICIENT_DTYPES:
        return "cuda"
    return None


def _flash_admits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """torch's own verdict on its CUDA flash kernel for these blocks (GPU generation, head size, strides)."""
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    except TypeError:  # torch 2.4: no enable_gqa argument yet
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False)
    return torch.backends.cuda.can_use_flash_attention(params)


def _unit_last_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fused kernels, called directly, read the head dim as contiguous: a view with a strided
    head dim (tokens flattened from a channels-first grid) gave garbage, silently."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _block_forward(q, k, v, bias, scale, differentiable_lse: bool = False):
    """Attention of ``q`` over one key block: the block's output and per-row log-sum-exp.

    The fused CPU kernel reports lse 0 (not -inf) for fully masked rows, fixed here; fused lse
    has no gradient, so callers that differentiate through the lse get the explicit path.
    """
    kind = None if differentiable_lse else _fused(q, k, v, bias)
    if kind is not None:
        q, k, v = _unit_last_stride(q, k, v)
    if kind == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        if bias is not None:
            lse = lse.masked_fill(torch.isneginf(bias).all(-1), float("-inf"))
        return out, lse
    if kind == "cuda":
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
        return out, lse[..., : q.shape[-2]]  # the kernel pads the lse rows
    if kind == "cuda_flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
        return out, lse
    scores = _scores(q, k, bias, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    return torch.matmul(probs, v), lse


def _merge(out, lse, block_out, block_lse):
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], merged


def _rotate(payload: torch.Tensor, meta: RingMeta, incoming_owner: int) -> collectives.PendingExchange:
    """Send ``payload`` to the next rank; receive the previous rank's block (of ``incoming_owner``)."""
    nxt, prv = (meta.me + 1) % meta.size, meta.previous
    shape = list(payload.shape)
    shape[-2] = meta.kv_sizes[incoming_owner]
    return collectives.start_exchange({nxt: payload}, {prv: shape}, meta.group, dtype=payload.dtype, device=payload.device)


def _block_backward(grad_out, q, k, v, out, safe_lse, delta, bias, scale):
    """Gradients of one (queries x key block) pair given the GLOBAL output and log-sum-exp:
    with those, each block's softmax probabilities and correction term are exact."""
    kind = _fused(q, k, v, bias)
    if kind is not None:
        grad_out, q, k, v, out = _unit_last_stride(grad_out, q, k, v, out)
    if kind == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, safe_lse[..., 0], 0.0, False, attn_mask=bias, scale=scale
        )
    if kind == "cuda":
        lse = safe_lse[..., 0].float()
        lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel's lse rows are padded to 32
        empty = torch.zeros((), dtype=torch.int64, device=q.device)
        grad_out, out = grad_out.contiguous(), out.contiguous()
        grads = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, lse.contiguous(), empty, empty, 0.0, [True, True, True, False], False, scale=scale
        )
        return grads[:3]
    if kind == "cuda_flash":
        # None stands for the undefined tensors of a dense (not variable-length) call without dropout
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out.contiguous(), q, k, v, out.contiguous(), safe_lse[..., 0].float().contiguous(), None, None,
            q.shape[-2], k.shape[-2], 0.0, False, None, None, scale=scale,
        )
    # The lse is kept in fp32; probabilities go back to the inputs' dtype for the matmuls.
    probs = torch.exp(_scores(q, k, bias, scale) - safe_lse).to(q.dtype)
    grad_scores = (probs * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta)).to(q.dtype)
    return (
        torch.matmul(grad_scores, k) * scale,
        torch.matmul(grad_scores.transpose(-1, -2), q) * scale,
        torch.matmul(probs.transpose(-1, -2), grad_out),
    )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta: RingMeta):  # type: ignore[override]
        e_k = k.shape[-1]
        # Blocks merge in at least fp32 (the fused kernel's lse is fp32 even for bf16 inputs).
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        block = torch.cat([k, v], dim=-1)
        for step in range(meta.size):
            owner = (meta.me - step) % meta.size
            pending = _rotate(block, meta, (owner - 1) % meta.size) if step + 1 < meta.size else None
            bias = _block_bias(meta, q.shape[-2], owner, block.shape[-2], q.device, q.dtype)
            block_out, block_lse = _block_forward(q, block[..., :e_k], block[..., e_k:], bias, meta.scale)
            out, lse = _merge(out, lse, block_out, block_lse)
            if pending is not None:
                block = pending.wait()[meta.previous]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = meta
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        if creating_graph():
            return (*_differentiable_ring_backward(ctx, grad_out), None)
        q, k, v, out, lse = ctx.saved_tensors
        meta: RingMeta = ctx.meta
        e_k = k.shape[-1]
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1, keepdim=True)
        safe_lse = _finite(lse)[..., None]
        grad_q = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)  # summed unrounded
        ring = meta.size > 1
        # K/V blocks circle as in the forward, each one step ahead of its use; the (dK, dV) of the
        # block just computed follow one step behind, so both travel while a block is computed
        kv = torch.cat([k, v], dim=-1)
        next_kv = _rotate(kv, meta, meta.previous) if ring else None
        partial = None  # the (dK, dV) the previous ranks summed for the block now computed
        for step in range(meta.size):
            owner = (meta.me - step) % meta.size
            bias = _block_bias(meta, q.shape[-2], owner, kv.shape[-2], q.device, q.dtype)
            block_grads = _block_backward(grad_out, q, kv[..., :e_k], kv[..., e_k:], out, safe_lse, delta, bias, meta.scale)
            grad_q += block_grads[0]
            summed = torch.cat(block_grads[1:], dim=-1)
            if step + 1 < meta.size:  # (a message is taken before the next one is sent: see HostChannel.send)
                kv = next_kv.wait()[meta.previous]
                if step + 2 < meta.size:
                    next_kv = _rotate(kv, meta, (owner - 2) % meta.size)
            if partial is not None:
                summed += partial.wait()[meta.previous]
            partial = _rotate(summed, meta, (owner - 1) % meta.size) if ring else None
        # after the last step each block's sum has reached its owner
        grads = partial.wait()[meta.previous] if ring else summed
        grad_k, grad_v = grads[..., :e_k], grads[..., e_k:]
        return grad_q.to(q.dtype), grad_k.contiguous(), grad_v.contiguous(), None


def _differentiable_ring_backward(ctx, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
    """Ring attention's gradients as differentiable functions of q, k, v and ``grad_out`` (double backward).

    Every rank gathers all keys and values with the window gather (its backward, sending each
    rank's key gradients home, differentiates again), attends over them with explicit scores and
    differentiates that with ``create_graph``: whole K/V per rank, paid only by a double backward.
    """
    # a view each: one tensor passed as key and value (self-attention) gets one gradient per argument
    q, k, v = (t.view_as(t) for t in ctx.saved_tensors[:3])
    meta: RingMeta = ctx.meta
    total = sum(meta.kv_sizes)
    windows, dim = ((0, total),) * meta.size, k.ndim - 2
    k_all = gather_window(k, dim, meta.kv_sizes, windows, group=meta.group)
    v_all = gather_window(v, dim, meta.kv_sizes, windows, group=meta.group)
    whole = dataclasses.replace(meta, kv_sizes=(total,))
    bias = _block_bias(whole, q.shape[-2], 0, total, q.device, q.dtype)
    out, _ = _block_forward(q, k_all, v_all, bias, meta.scale, differentiable_lse=True)
    inputs = (q, k, v)
    wanted = [t for t, need in zip(inputs, ctx.needs_input_grad) if need]
    grads = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=True) if wanted else ())
    return [next(grads) if need else None for need in ctx.needs_input_grad[:3]]


# ----- argument handling --------------------------------------------------------------------
def _token_axes(t: Any) -> list[int]:
    if not isinstance(t, ShardTensor):
        return []
    return [a for a, p in enumerate(t.placements) if type(p) is Shard and p.dim == t.ndim - 2]


def _check(q, k, v, mask, dropout_p, tensors) -> None:
    if dropout_p:
        raise ShardedOpError(_OP, tensors, "dropout_p > 0 is not supported on sharded tokens; use dropout outside attention")
    for t in tensors:
        if t._spec.has_partial:
            raise ShardedOpError(_OP, tensors, "inputs with pending reductions (Partial) must be reduced first")
        if any(type(p) is Shard and p.dim == t.ndim - 1 for p in t.placements):
            raise ShardedOpError(_OP, tensors, "the embedding dim must not be sharded")
    if isinstance(mask, ShardTensor) and any(not p.is_replicate() for p in mask.placements):
        raise ShardedOpError(_OP, tensors, "attn_mask must be a plain or replicated tensor (it is sliced per block)")
    for name, t in (("key", k), ("value", v)):
        if isinstance(t, ShardTensor) != isinstance(k, ShardTensor) or (
            isinstance(t, ShardTensor) and t.placements != k.placements
        ):
            raise ShardedOpError(_OP, tensors, f"{name} must have the same placements as key")
    if len(_token_axes(q)) > 1 or len(_token_axes(k)) > 1:
        raise ShardedOpError(_OP, tensors, "tokens may be sharded over one mesh axis only")
    if isinstance(q, ShardTensor) and isinstance(k, ShardTensor):
        others = [a for a in range(q.device_mesh.ndim) if a not in _token_axes(q) + _token_axes(k)]
        if any(q.placements[a] != k.placements[a] for a in others):
            raise ShardedOpError(_OP, tensors, "query and key/value must be laid out alike on the non-token mesh axes")


def _local(t: Any, axes_to_sum: list[int], mesh) -> torch.Tensor:
    if isinstance(t, ShardTensor):
        return sum_grad_over_axes(local_input(t), mesh, axes_to_sum)
    return t if not axes_to_sum else sum_grad_over_axes(t, mesh, axes_to_sum)


def _expand_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool):
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        return k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    return k, v


def _slice_batch_dims(mask: torch.Tensor, q: ShardTensor, token_axis: int) -> torch.Tensor:
    """This rank's batch/head slab of a whole tensor (a mask, or keys every rank holds) when
    those dims of ``q`` are sharded on other axes; dims align from the right as in broadcasting."""
    offsets = q._spec.offsets()
    local = q._spec.local_shape()
    for axis, placement in enumerate(q.placements):
        if axis == token_axis or type(placement) is not Shard:
            continue
        mask_dim = placement.dim - (q.ndim - mask.ndim)
        if mask_dim >= 0 and mask.shape[mask_dim] > 1:
            mask = mask.narrow(mask_dim, offsets[placement.dim], local[placement.dim])
    return mask


def _strided_token_axes(t: Any) -> list[int]:
    if not isinstance(t, ShardTensor) or not t._spec.strided:
        return []
    return [a for a, p in enumerate(t.placements) if type(p) is StridedShard and p.dim == t.ndim - 2]


def _strided_ring(q: ShardTensor, k: ShardTensor, v: ShardTensor, scale: float | None, enable_gqa: bool) -> ShardTensor:
    """Self-attention over tokens split over several mesh axes (a flattened 2-D decomposition).

    Attention without a mask or causality does not depend on the order of keys, so the ring runs
    through every rank holding a share of the tokens, in any order, with nothing gathered.
    """
    axes = _strided_token_axes(q)
    mesh = q.device_mesh
    with outside_trace():  # a plan from integer sizes: eager even under torch.compile
        group, members = group_over_axes(mesh, axes)
        kv_sizes = tuple(k._spec.local_shape(c)[-2] for c in members)
    meta = RingMeta(
        group=group,
        me=members.index(tuple(mesh.get_coordinate())),
        size=len(members),
        q_offset=0,
        kv_sizes=kv_sizes,
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        causal=False,
        mask=None,
    )
    q_l, k_l, v_l = local_input(q), local_input(k), local_input(v)
    k_l, v_l = _expand_heads(q_l, k_l, v_l, enable_gqa)
    out = _RingAttention.apply(q_l, k_l, v_l, meta)
    return wrap_local(out, q, (*q.shape[:-1], v.shape[-1]), q._spec.axis_sizes)


def _sdpa_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    # cast as torch's op is under autocast (below this handler), so the ring's kernels run in that dtype
    casts = lower_precision(bound["query"], bound["key"], bound["value"], bound.get("attn_mask"))
    bound.update(zip(("query", "key", "value", "attn_mask"), casts))
    args, kwargs = (), bound
    q, k, v = bound["query"], bound["key"], bound["value"]
    if any(isinstance(t, ShardTensor) and t._spec.strided for t in (q, k, v)):
        ring = (
            _strided_token_axes(q)
            and all(isinstance(t, ShardTensor) and t.placements == q.placements for t in (k, v))
            and bound.get("attn_mask") is None
            and not bound.get("is_causal", False)
            and not bound.get("dropout_p", 0.0)
            and not q._spec.has_partial
        )
        if ring:
            return _strided_ring(q, k, v, bound.get("scale"), bound.get("enable_gqa", False))
        # masks and causality need tokens in global order: a contiguous layout
        q, k, v = (without_strided_dims(t) if isinstance(t, ShardTensor) else t for t in (q, k, v))
        bound.update(query=q, key=k, value=v)
    mask, dropout_p = bound.get("attn_mask"), bound.get("dropout_p", 0.0)
    causal, scale, enable_gqa = bound.get("is_causal", False), bound.get("scale"), bound.get("enable_gqa", False)
    q_axes, kv_axes = _token_axes(q), _token_axes(k)
    if not q_axes and not kv_axes:
        return run_default(func, args, kwargs)
    tensors = [t for t in (q, k, v) if isinstance(t, ShardTensor)]
    _check(q, k, v, mask, dropout_p, tensors)
    if causal and mask is not None:
        raise ShardedOpError(_OP, tensors, "attn_mask and is_causal together are rejected, as by torch")
    if q_axes and kv_axes and q_axes != kv_axes:
        raise ShardedOpError(_OP, tensors, "query and key/value tokens must be sharded over the same mesh axis")
    axis = (q_axes or kv_axes)[0]
    anchor = tensors[0]
    mesh = anchor.device_mesh
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    mask_full = mask.full_tensor() if isinstance(mask, ShardTensor) else mask
    if mask_full is not None and isinstance(q, ShardTensor):
        mask_full = _slice_batch_dims(mask_full, q, axis)
    q_sizes = q._spec.axis_sizes[axis] if q_axes else (q.shape[-2],) * mesh.size(axis)
    kv_sizes = k._spec.axis_sizes[axis] if kv_axes else (k.shape[-2],) * mesh.size(axis)
    me = mesh.get_coordinate()[axis]
    meta = RingMeta(
        group=mesh.get_group(axis),
        me=me,
        size=mesh.size(axis),
        q_offset=_offsets(q_sizes)[me] if q_axes else 0,
        kv_sizes=tuple(kv_sizes) if kv_axes else (k.shape[-2],),
        scale=scale,
        causal=causal,
        mask=_additive_mask(mask_full, q.dtype),
    )
    q_l = _local(q, [] if q_axes else [axis], mesh)
    if kv_axes:
        k_l, v_l = _local(k, [], mesh), _local(v, [], mesh)
    else:  # whole on every rank: this rank's batch/head slab, gradient shares summed over q's axes
        q_axes_all = [a for a, p in enumerate(q.placements) if type(p) is Shard]
        k_l = _slice_batch_dims(_local(k, q_axes_all, mesh), q, axis)
        v_l = _slice_batch_dims(_local(v, q_axes_all, mesh), q, axis)
    k_l, v_l = _expand_heads(q_l, k_l, v_l, enable_gqa)
    if q_axes and kv_axes:
        out = _RingAttention.apply(q_l, k_l, v_l, meta)
    elif q_axes:  # keys whole on every rank: the single "block" is owner 0 in a ring of one
        local_meta = RingMeta(meta.group, 0, 1, meta.q_offset, (k_l.shape[-2],), scale, causal, meta.mask)
        bias = _block_bias(local_meta, q_l.shape[-2], 0, k_l.shape[-2], q_l.device, q_l.dtype)
        out, _ = _block_forward(q_l, k_l, v_l, bias, scale)
    else:
        bias = _block_bias(meta, q_l.shape[-2], me, k_l.shape[-2], q_l.device, q_l.dtype)
        block_out, block_lse = _block_forward(q_l, k_l, v_l, bias, scale, differentiable_lse=True)
        peak = collectives.all_reduce(block_lse.detach(), "max", meta.group)
        weight = torch.exp(block_lse - _finite(peak))
        total = sum_replicated(weight, [meta.group])
        out = sum_replicated(block_out * weight[..., None], [meta.group]) / torch.where(total > 0, total, 1)[..., None]
    shape = (*q.shape[:-1], v.shape[-1])
    like = q if isinstance(q, ShardTensor) else anchor
    if not isinstance(q, ShardTensor):
        like = ShardTensor(q, like._spec.replace(placements=[Replicate()] * mesh.ndim, shape=q.shape))
    return wrap_local(out, like, shape, like._spec.axis_sizes)


_MHA_ARGS = (
    "query key value embed_dim_to_check num_heads in_proj_weight in_proj_bias bias_k bias_v add_zero_attn "
    "dropout_p out_proj_weight out_proj_bias training key_padding_mask need_weights attn_mask "
    "use_separate_proj_weight q_proj_weight k_proj_weight v_proj_weight static_k static_v "
    "average_attn_weights is_causal"
).split()


def _mha_handler(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """``nn.MultiheadAttention`` on (L, N, E) tokens sharded over L, via sharded linear + ring attention.

    torch's own implementation runs with subclass dispatch disabled below its entry point, which
    would bypass the sharded attention; this spells out the same computation on ShardTensors.
    """
    a = dict(zip(_MHA_ARGS, args))
    a.update(kwargs)
    query, key, value = a["query"], a["key"], a["value"]
    tensors = [t for t in (query, key, value) if isinstance(t, ShardTensor)]
    unsupported = {
        "bias_k/bias_v": a.get("bias_k") is not None or a.get("bias_v") is not None,
        "add_zero_attn": a.get("add_zero_attn", False),
        "key_padding_mask (fold it into attn_mask)": a.get("key_padding_mask") is not None,
        "static_k/static_v": a.get("static_k") is not None or a.get("static_v") is not None,
        "dropout in training": a.get("training", True) and a.get("dropout_p", 0.0) > 0,
    }
    reasons = [name for name, present in unsupported.items() if present]
    if reasons:
        raise ShardedOpError("multi_head_attention_forward", tensors, "unsupported on sharded tokens: " + ", ".join(reasons))
    heads = a["num_heads"]
    tgt_len, batch, embed = query.shape
    src_len = key.shape[0]
    head_dim = embed // heads
    if a.get("use_separate_proj_weight", False):
        weights = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
    else:
        weights = a["in_proj_weight"].chunk(3)
    bias = a["in_proj_bias"]
    biases = bias.chunk(3) if bias is not None else (None, None, None)

    def heads_first(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, length: int) -> torch.Tensor:
        projected = F.linear(x, w, b)
        return projected.view(length, batch * heads, head_dim).transpose(0, 1).view(batch, heads, length, head_dim)

    q = heads_first(query, weights[0], biases[0], tgt_len)
    k = heads_first(key, weights[1], biases[1], src_len)
    v = heads_first(value, weights[2], biases[2], src_len)
    mask = a.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:  # torch's MHA masks where True; SDPA keeps where True
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if mask is not None and mask.dim() == 3:
        mask = mask.view(batch, heads, tgt_len, src_len)
    causal = bool(a.get("is_causal", False)) and mask is None
    weights = None
    if a.get("need_weights", True):
        out, weights = _attention_with_weights(q, k, v, mask, causal)
        if a.get("average_attn_weights", True):
            weights = weights.mean(1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    out = out.permute(2, 0, 1, 3).reshape(tgt_len * batch, embed)
    out = F.linear(out, a["out_proj_weight"], a["out_proj_bias"])
    return out.view(tgt_len, batch, embed), weights


def _attention_with_weights(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns its (N, heads, L, S) weights, as torch's MHA does for
    ``need_weights=True``: the weights are materialized there too, so the ring buys nothing.
    Each rank computes the rows of its queries against every key (the keys gathered by the
    sharded matmul), so it holds L / ranks rows of the weights."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if mask is not None:
        scores = scores + mask
    weights = scores.softmax(-1)
    return weights @ v, weights


ShardTensor.register_function_handler(F.scaled_dot_product_attention, _sdpa_handler, strided=True)
ShardTensor.register_function_handler(F.multi_head_attention_forward, _mha_handler)
