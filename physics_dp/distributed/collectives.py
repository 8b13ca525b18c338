"""Collectives over one mesh axis, with exact per-rank byte accounting.

Every byte physics_dp sends goes through this module, so tests can assert that an op sends
exactly what it must (a halo sends only its rows, a pointwise op sends nothing) by wrapping
it in :func:`count_communication`.  Variable-size collectives are built on
``all_to_all_single`` because gloo's ``all_gather`` refuses tensors of different sizes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

from .host_channel import HostChannel, channel_for, opened_channel
from .tracing import is_tracing, kept_in_backward

__all__ = [
    "CommRecord",
    "CommLog",
    "count_communication",
    "all_gather_along_dim",
    "all_gather_rows",
    "all_to_all_chunks",
    "all_to_all_into",
    "all_to_all_joined",
    "all_reduce",
    "reduce_op_for",
    "barrier",
    "gather_sizes",
    "group_rank",
    "broadcast",
    "exchange_with_neighbours",
    "start_exchange",
    "PendingExchange",
]


@dataclass(frozen=True)
class CommRecord:
    """One collective issued by this rank: its kind and the payload bytes it sent to peers."""

    kind: str
    bytes_sent: int


@dataclass
class CommLog:
    """The collectives issued inside a :func:`count_communication` block on this rank."""

    records: list[CommRecord] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    @property
    def calls(self) -> int:
        return len(self.records)

    def kinds(self) -> list[str]:
        return [r.kind for r in self.records]


_active_logs: list[CommLog] = []


@contextlib.contextmanager
def count_communication() -> Iterator[CommLog]:
    """Record every physics_dp collective issued by this rank inside the block."""
    log = CommLog()
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)


def _record(kind: str, nbytes: int) -> None:
    for log in _active_logs:
        log.records.append(CommRecord(kind, int(nbytes)))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size() if group is None else group.size()


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group`` (None: the world), read off the group itself: every halo
    exchange asks, and ``dist.get_rank(group)`` takes eight Python calls to check membership
    (every group physics_dp passes is one of this process's mesh groups)."""
    return dist.get_rank() if group is None else group.rank()


def all_to_all_chunks(
    send: Sequence[torch.Tensor],
    recv_shapes: Sequence[Sequence[int]],
    group: ProcessGroup,
) -> list[torch.Tensor]:
    """Send ``send[j]`` to group rank ``j``; receive a tensor of ``recv_shapes[j]`` from each.

    Sizes may differ per peer (including zero).  The chunk kept for oneself is copied locally,
    so the bytes recorded are only those that leave this rank.
    """
    ref = send[0]
    if is_tracing():
        return _traced_all_to_all(send, recv_shapes, group)
    outs = [torch.empty(tuple(s), dtype=ref.dtype, device=ref.device) for s in recv_shapes]
    all_to_all_into(send, outs, group)
    return outs


def all_to_all_into(send: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], group: ProcessGroup) -> None:
    """Send ``send[j]`` to group rank ``j`` and write what rank ``j`` sends into ``outs[j]``.

    ``outs`` may be views into one result (the pieces' places in it), so nothing is concatenated
    afterwards; pieces on both sides may have any strides.  Between ranks of one host the pieces go
    through shared memory, straight from ``send`` into ``outs``.
    """
    me = group_rank(group)
    ref = send[0]
    in_splits = [t.numel() for t in send]
    if is_tracing():
        for out, piece in zip(outs, _traced_all_to_all(send, [o.shape for o in outs], group)):
            out.copy_(piece)
        return
    _record("all_to_all", (sum(in_splits) - in_splits[me]) * ref.element_size())
    channel = channel_for(group, ref, None)
    if channel is not None:
        channel.all_to_all(list(send), list(outs))
        return
    out_splits = [o.numel() for o in outs]
    # each piece is written once, straight into the send buffer (strided pieces included)
    send_buffer = torch.empty(sum(in_splits), dtype=ref.dtype, device=ref.device)
    for piece, chunk in zip(send, torch.split(send_buffer, in_splits)):
        chunk.view(piece.shape).copy_(piece)
    recv_buffer = torch.empty(sum(out_splits), dtype=ref.dtype, device=ref.device)
    dist.all_to_all_single(recv_buffer, send_buffer, out_splits, in_splits, group=group)
    for out, piece in zip(outs, torch.split(recv_buffer, out_splits)):
        out.copy_(piece.view(out.shape))


def all_to_all_joined(
    send: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]], dim: int, group: ProcessGroup
) -> torch.Tensor:
    """:func:`all_to_all_chunks` with the received pieces concatenated along ``dim``, each written
    straight into its place in the result."""
    if is_tracing():
        return torch.cat(_traced_all_to_all(send, recv_shapes, group), dim=dim)
    shape = list(recv_shapes[0])
    shape[dim] = sum(s[dim] for s in recv_shapes)
    out = torch.empty(shape, dtype=send[0].dtype, device=send[0].device)
    offsets = [0]
    for s in recv_shapes[:-1]:
        offsets.append(offsets[-1] + s[dim])
    all_to_all_into(send, [out.narrow(dim, o, s[dim]) for o, s in zip(offsets, recv_shapes)], group)
    return out


def _traced_all_to_all(
    send: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]], group: ProcessGroup
) -> list[torch.Tensor]:
    """The all-to-all as one functional collective, which torch.compile can trace."""
    in_splits = [t.numel() for t in send]
    out_splits = [int(torch.Size(s).numel()) for s in recv_shapes]
    received = _functional_all_to_all(torch.cat([piece.reshape(-1) for piece in send]), out_splits, in_splits, group)
    return [p.view(tuple(s)) for p, s in zip(torch.split(received, out_splits), recv_shapes)]


def all_gather_rows(flat: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every group rank's 1-D ``flat`` (one length on all), stacked in rank order: (world, length).

    For small messages of a known, equal size (merged statistics): no shape exchange, and through
    the host channel one exchange and one copy.
    """
    world = _group_size(group)
    if world == 1:
        return flat.unsqueeze(0)
    if is_tracing():
        with kept_in_backward():
            return funcol.all_gather_tensor(flat.contiguous(), 0, group).view(world, -1)
    _record("all_gather", _nbytes(flat) * (world - 1))
    return _stacked_rows(flat, group, world)


def _stacked_rows(flat: torch.Tensor, group: ProcessGroup, world: int) -> torch.Tensor:
    """The exchange behind :func:`all_gather_rows` and :func:`gather_sizes` (eager, ``world`` > 1)."""
    channel = channel_for(group, flat, _nbytes(flat))
    if channel is not None:
        return channel.gather_rows(flat)
    out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)  # gloo takes a flat output only
    dist.all_gather_into_tensor(out, flat.contiguous(), group=group)
    return out.view(world, -1)


def all_gather_along_dim(
    local: torch.Tensor, sizes: Sequence[int], dim: int, group: ProcessGroup
) -> torch.Tensor:
    """Concatenate along ``dim`` the pieces of every group rank, whose extents are ``sizes``."""
    world = _group_size(group)
    if world == 1:
        return local
    moved = local.movedim(dim, 0).contiguous()
    tail = tuple(moved.shape[1:])
    row = math.prod(tail)
    channel = channel_for(group, moved, max(sizes) * row * moved.element_size())
    if channel is not None:
        _record("all_to_all", _nbytes(moved) * (world - 1))
        gathered = channel.all_gather(moved.reshape(-1), [n * row for n in sizes]).view(sum(sizes), *tail)
        return gathered.movedim(0, dim).contiguous()
    shapes = [[n if d == dim else extent for d, extent in enumerate(local.shape)] for n in sizes]
    return all_to_all_joined([local] * world, shapes, dim, group)


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: AVG is not supported by every backend
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
_BOOLEAN_REDUCE_OPS = {"sum": "max", "avg": "max", "product": "min"}


def reduce_op_for(reduce_op: str, dtype: torch.dtype) -> str:
    """The reduce op that means ``reduce_op`` for ``dtype``: on booleans a sum is a logical or and a
    product a logical and, as NCCL computes them and as DTensor's rules for ``any`` / ``all``
    (``Partial("sum")`` / ``Partial("product")``) assume; gloo and a plain sum would add bytes."""
    return _BOOLEAN_REDUCE_OPS.get(reduce_op, reduce_op) if dtype is torch.bool else reduce_op


def all_reduce(tensor: torch.Tensor, reduce_op: str, group: ProcessGroup) -> torch.Tensor:
    """Out-of-place all-reduce with reduce op named as in ``Partial`` ("sum", "avg", "max", "min", "product")."""
    world = _group_size(group)
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce op {reduce_op!r}; expected one of {sorted(_REDUCE_OPS)}")
    reduce_op = reduce_op_for(reduce_op, tensor.dtype)
    if is_tracing() and world > 1:
        with kept_in_backward():
            out = funcol.all_reduce(tensor.contiguous(), "sum" if reduce_op == "avg" else reduce_op, group)
        return out / world if reduce_op == "avg" else out
    if world == 1:
        return tensor.contiguous().clone()
    _record("all_reduce", _nbytes(tensor))
    channel = channel_for(group, tensor, None)
    if channel is not None:
        out = channel.all_reduce(tensor, "sum" if reduce_op == "avg" else reduce_op)
    else:
        out = tensor.contiguous().clone()
        dist.all_reduce(out, op=_REDUCE_OPS[reduce_op], group=group)
    if reduce_op == "avg":
        out = out / world
    return out


def barrier(group: ProcessGroup | None = None) -> None:
    """Return once every rank of ``group`` has called it, through the group's host channel where its
    ranks share one (tens of microseconds), else ``dist.barrier``.

    Timing between barriers needs this precision: gloo's barrier takes 0.1 ms back to back, but
    0.3-4 ms after a few milliseconds of compute, and its ranks leave it up to 3 ms apart.
    Carries no payload, so :func:`count_communication` does not count it.
    """
    group = group if group is not None else dist.group.WORLD
    if _group_size(group) == 1:
        return
    token = torch.zeros(1)
    channel = channel_for(group, token, None)
    if channel is None:
        dist.barrier(group=group)
    else:
        channel.all_reduce(token, "sum")


def gather_sizes(values: Sequence[int], group: ProcessGroup) -> list[list[int]]:
    """All-gather a short list of ints from every group rank (shape discovery)."""
    world = _group_size(group)
    mine = torch.tensor(list(values), dtype=torch.int64)
    if world == 1:
        return [mine.tolist()]
    if is_tracing():
        raise RuntimeError(
            "slab sizes cannot be discovered inside torch.compile (they would be data in the graph): "
            "state them (ShardTensor.from_local(..., sharding_shapes=...)) or build the ShardTensor outside "
            "the compiled function"
        )
    _record("all_gather_sizes", _nbytes(mine) * (world - 1))
    return _stacked_rows(mine, group, world).tolist()


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup) -> torch.Tensor:
    """Broadcast in place from the group rank ``src_group_rank``."""
    if _group_size(group) == 1:
        return tensor
    if is_tracing():
        with kept_in_backward():
            return funcol.broadcast(tensor, src_group_rank, group)
    if group_rank(group) == src_group_rank:
        _record("broadcast", _nbytes(tensor) * (_group_size(group) - 1))
    dist.broadcast(tensor, group_src=src_group_rank, group=group)
    return tensor


class PendingExchange:
    """Point-to-point messages in flight; ``wait()`` returns what was received, keyed by peer."""

    def __init__(
        self,
        requests: list,
        received: dict[int, torch.Tensor],
        channel: HostChannel | None = None,
        channel_receives: list[tuple[int, int, tuple[int, ...], torch.dtype]] | None = None,
    ) -> None:
        self._requests = requests
        self._received = received
        self._channel = channel
        self._channel_receives = channel_receives or []

    def wait(self) -> dict[int, torch.Tensor]:
        for request in self._requests:
            request.wait()
        self._requests = []
        for peer, number, shape, dtype in self._channel_receives:
            self._received[peer] = self._channel.receive(peer, number, shape, dtype)
        self._channel_receives = []
        return self._received


def start_exchange(
    sends: dict[int, torch.Tensor],
    recv_shapes: dict[int, Sequence[int]],
    group: ProcessGroup | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    anchor: torch.Tensor | None = None,
) -> PendingExchange:
    """Start a point-to-point exchange keyed by group rank (see ``exchange_with_neighbours``).

    Returning before completion lets ring algorithms compute on one block while the next travels.
    Messages that fit the group's host channel go through shared memory, the rest over gloo.
    """
    if is_tracing():
        return _traced_exchange(sends, recv_shapes, group, dtype=dtype, device=device, anchor=anchor)
    lookup_group = group if group is not None else dist.group.WORLD
    itemsize = dtype.itemsize
    ops = []
    received: dict[int, torch.Tensor] = {}
    channel, channel_receives = None, []
    # receives are posted first, so a peer's message lands in its buffer as it arrives
    for peer, shape in recv_shapes.items():
        shape = tuple(shape)
        numel = int(torch.Size(shape).numel())
        peer_channel = opened_channel(lookup_group, device, numel * itemsize) if numel else None
        if peer_channel is not None:
            channel = peer_channel
            channel_receives.append((peer, peer_channel.post_receive(peer), shape, dtype))
            continue
        buffer = torch.empty(shape, dtype=dtype, device=device)
        received[peer] = buffer
        if numel:
            ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=peer))
    for peer, tensor in sends.items():
        if not tensor.numel():
            continue
        _record("p2p", _nbytes(tensor))
        peer_channel = opened_channel(lookup_group, tensor.device, _nbytes(tensor))
        if peer_channel is not None:
            peer_channel.send(peer, tensor)
            continue
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), group=group, group_peer=peer))
    requests = dist.batch_isend_irecv(ops) if ops else []
    return PendingExchange(requests, received, channel, channel_receives)


def _functional_all_to_all(flat: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of a 1-D tensor through functional collectives (complex as real pairs)."""
    with kept_in_backward():
        if not flat.dtype.is_complex:
            return funcol.all_to_all_single(flat, out_splits, in_splits, group)
        pairs = funcol.all_to_all_single(
            torch.view_as_real(flat).reshape(-1), [2 * n for n in out_splits], [2 * n for n in in_splits], group
        )
    return torch.view_as_complex(pairs.view(-1, 2))


def _traced_exchange(
    sends: dict[int, torch.Tensor],
    recv_shapes: dict[int, Sequence[int]],
    group: ProcessGroup | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    anchor: torch.Tensor | None,
) -> PendingExchange:
    """A point-to-point exchange as one functional ``all_to_all_single`` (traceable by torch.compile).

    Every rank of ``group`` takes part in the exchange patterns physics_dp uses (halos, rings),
    so each rank joining one all-to-all with empty pieces for non-peers matches the messages.
    A rank that sends nothing still sends an empty slice of ``anchor`` (the op's input): an
    exchange that reads nothing traced could be placed in either graph, and the partitioner may
    put it elsewhere on that rank alone (a forward exchange recomputed in the backward), so the
    ranks' collectives would no longer pair up.  Backward collectives are also pinned by
    :func:`.tracing.kept_in_backward`.
    """
    group = group if group is not None else dist.group.WORLD
    world = _group_size(group)
    in_splits = [sends[j].numel() if j in sends else 0 for j in range(world)]
    out_splits = [int(torch.Size(recv_shapes[j]).numel()) if j in recv_shapes else 0 for j in range(world)]
    pieces = [sends[j].reshape(-1).to(dtype) for j in range(world) if in_splits[j]]
    if not pieces:
        pieces = [anchor.reshape(-1)[:0].to(dtype) if anchor is not None else torch.empty(0, dtype=dtype, device=device)]
    payload = torch.cat(pieces)
    received = torch.split(_functional_all_to_all(payload, out_splits, in_splits, group), out_splits)
    return PendingExchange([], {j: received[j].view(tuple(recv_shapes[j])) for j in recv_shapes})


def exchange_with_neighbours(
    sends: dict[int, torch.Tensor],
    recv_shapes: dict[int, Sequence[int]],
    group: ProcessGroup | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    anchor: torch.Tensor | None = None,
) -> dict[int, torch.Tensor]:
    """Point-to-point exchange keyed by group rank: send ``sends[peer]``, receive ``recv_shapes[peer]``.

    Empty messages are skipped on both sides (both sides know the sizes), so a zero-width
    halo costs nothing.
    """
    return start_exchange(sends, recv_shapes, group, dtype=dtype, device=device, anchor=anchor).wait()
