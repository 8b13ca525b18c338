"""Sums of parameter gradients over the mesh axes that split the data: bucketed at the end of backward.

Also the differentiable sums over ranks that backwards use under ``create_graph`` (a double
backward): :func:`sum_shares`, :func:`sum_replicated` and :func:`creating_graph`.

Each rank's local compute yields only its slab's share of a shared parameter's gradient; the
shares must be summed over the sharded axes exactly once.  Summing at every use costs one
collective per parameter use (hundreds per step, each with gloo's ~0.3 ms floor).  Instead, a
use of a *leaf* parameter whose gradient autograd is about to accumulate keeps its share out of
autograd and adds it to a per-backward stash; when the backward pass ends, the stashes are packed
into buckets of at most ``BUCKET_BYTES`` (in backward order, identical on every rank) and each
bucket is summed with one all-reduce, then added to ``.grad``.  Collectives per step: the number
of buckets.

A share is summed at once, as before, where deferring could be observed:

- the parameter is not a leaf (a cast or view of one, FSDP's and DTensor's local views);
- the parameter has gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``):
  they must see the whole gradient when autograd accumulates it;
- autograd will not accumulate into it (``torch.autograd.grad``, ``backward(inputs=...)``
  without it): the captured gradient itself must be the sum;
- under ``create_graph`` (a double backward): the sum is itself differentiated
  (:func:`sum_replicated`);
- inside :func:`immediate_parameter_sums`, which the FSDP/DDP output adapter enters: their
  hooks read ``.grad`` during backward, before the end of the pass.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch

from ..distributed import collectives
from ..distributed.tracing import is_tracing
from .moments import LOW_PRECISION

__all__ = [
    "BUCKET_BYTES",
    "immediate_parameter_sums",
    "sum_over_groups",
    "SumGradOverGroups",
    "creating_graph",
    "sum_shares",
    "sum_replicated",
]

BUCKET_BYTES = 32 * 2**20

_immediate_depth = 0


@contextlib.contextmanager
def immediate_parameter_sums() -> Iterator[None]:
    """Inside, parameter gradients are summed at each use (for wrappers that read ``.grad`` in backward)."""
    global _immediate_depth
    _immediate_depth += 1
    try:
        yield
    finally:
        _immediate_depth -= 1


def creating_graph() -> bool:
    """Whether the running backward must itself be differentiable (eager ``create_graph=True``).

    Such a backward builds its gradients from differentiable pieces (a plain backward keeps its
    fast in-place path).  A compiled backward is traced ahead of time with its own grad mode and
    takes the plain path (torch.compile does not differentiate its backward again).
    """
    return torch.is_grad_enabled() and not is_tracing()


def sum_over_groups(grad: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """The sum of every rank's ``grad`` over ``groups`` in turn (low precision summed in fp32)."""
    summed = grad.float() if grad.dtype in LOW_PRECISION else grad
    for group in groups:
        summed = collectives.all_reduce(summed, "sum", group)
    return summed.to(grad.dtype)


class _Stash:
    """This backward pass's deferred shares, in the order they arrived."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[torch.Tensor, tuple, torch.Tensor]] = {}

    def add(self, param: torch.Tensor, groups: tuple, share: torch.Tensor) -> None:
        share = share.float() if share.dtype in LOW_PRECISION else share
        entry = self.entries.get(id(param))
        self.entries[id(param)] = (param, groups, share if entry is None else entry[2] + share)

    def buckets(self) -> list[list[tuple[torch.Tensor, tuple, torch.Tensor]]]:
        """Entries grouped by (groups, dtype, device), split at ``BUCKET_BYTES``, in arrival order."""
        buckets: list[list] = []
        open_bucket: dict[tuple, tuple[list, int]] = {}
        for param, groups, share in self.entries.values():
            key = (groups, share.dtype, share.device)
            bucket, size = open_bucket.get(key, (None, 0))
            nbytes = share.numel() * share.element_size()
            if bucket is None or size + nbytes > BUCKET_BYTES:
                bucket, size = [], 0
                buckets.append(bucket)
            bucket.append((param, groups, share))
            open_bucket[key] = (bucket, size + nbytes)
        return buckets


# Deferred shares by the autograd graph task that collects them (``torch._C._current_graph_task_id``,
# as ``torch.utils.checkpoint`` uses it).  A pass that raises never runs
# its end-of-pass callback: a single module-level stash then outlived it, so no later pass queued
# a flush (its parameters' ``.grad`` silently stayed None or stale) and the failed pass's shares
# were added to the next one's.  Each pass now has its own stash; one left by a failed pass is
# dropped by the next forward use outside any backward (see ``SumGradOverGroups.forward``).
_stashes: dict[int, _Stash] = {}


@torch.no_grad()
def _flush(task: int) -> None:
    """End of backward pass ``task``: sum each bucket with one all-reduce and add it to ``.grad``."""
    stash = _stashes.pop(task, None)
    for stale in [t for t in _stashes if t > task]:  # nested passes that raised before their end
        del _stashes[stale]
    if stash is None:
        return
    for bucket in stash.buckets():
        flat = torch.cat([share.reshape(-1) for _, _, share in bucket])
        for group in bucket[0][1]:
            flat = collectives.all_reduce(flat, "sum", group)
        offset = 0
        for param, _, share in bucket:
            total = flat[offset:offset + share.numel()].view(param.shape).to(param.dtype)
            offset += share.numel()
            if param.grad is None:
                param.grad = total  # a view of the bucket: no copy
            else:
                param.grad.add_(total)


def _defer(param: torch.Tensor, groups: tuple, share: torch.Tensor) -> None:
    task = torch._C._current_graph_task_id()
    stash = _stashes.get(task)
    if stash is None:
        stash = _stashes[task] = _Stash()
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_flush, task))
    stash.add(param, groups, share)


def _has_grad_hooks(param: torch.Tensor) -> bool:
    """Hooks on the leaf (``register_hook``, ``register_post_accumulate_grad_hook``) must see the
    summed gradient as it is accumulated: a deferred share reached them as ``None`` (a pre-hook)
    or missing from ``.grad`` (a post-accumulate hook), and a hook's change of it was lost."""
    return bool(param._backward_hooks) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


class SumGradOverGroups(torch.autograd.Function):
    """Identity forward; backward sums the gradient share over ``groups`` (deferred and bucketed where safe)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, groups: tuple) -> torch.Tensor:  # type: ignore[override]
        ctx.groups = groups
        # a compiled backward is traced ahead of time: no end-of-pass callback can run inside it
        ctx.deferrable = param.is_leaf and _immediate_depth == 0 and not is_tracing()
        ctx.param = param if ctx.deferrable else None
        if ctx.deferrable and _stashes and torch._C._current_graph_task_id() == -1:
            _stashes.clear()  # outside every backward pass: stashes left by passes that raised
        return torch.ops.aten.alias(param)  # (view_as would recompute the strides of size-1 dims)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if creating_graph():  # the summed gradient must be differentiable, now
            return sum_replicated(grad, ctx.groups), None
        if ctx.deferrable and not _has_grad_hooks(ctx.param) and _will_accumulate(ctx.next_functions[0][0]):
            _defer(ctx.param, ctx.groups, grad)
            return None, None
        return sum_over_groups(grad, ctx.groups), None


class _SumOverRanks(torch.autograd.Function):
    """All-reduce sum; its gradient by how ranks use the sum (see :func:`sum_shares`, :func:`sum_replicated`)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, groups: tuple, shares: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.groups, ctx.shares = groups, shares
        return sum_over_groups(tensor, groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.shares:  # its own adjoint: differentiable any number of times
            return _SumOverRanks.apply(grad, ctx.groups, True), None, None
        # identity; differentiated again it is SumGradOverGroups, its adjoint: the output gradient
        # then feeds each rank's own local backward, whose shares must be summed on the way back
        return (SumGradOverGroups.apply(grad, ctx.groups) if creating_graph() else grad), None, None


def sum_shares(tensor: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """The sum over ``groups``, used differently by each rank (statistics of a sharded grid, each
    normalizing its own slab): each rank's gradient of the sum is only its share, so the input's
    gradient is the sum of the shares, an all-reduce again."""
    return _SumOverRanks.apply(tensor, tuple(groups), True)


def sum_replicated(tensor: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """The sum over ``groups``, used alike by every rank (a parameter's gradient, then a penalty on
    it): each rank's gradient of the sum is already the whole, and is the input's gradient."""
    return _SumOverRanks.apply(tensor, tuple(groups), False)


def _will_accumulate(node: torch.autograd.graph.Node) -> bool:
    """Whether this backward pass accumulates into the leaf behind ``node`` (not ``autograd.grad``)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # raised for leaves under torch.autograd.grad, which captures instead
        return False
