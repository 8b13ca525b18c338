"""Small collectives and point-to-point messages between ranks of one host, through shared memory.

Why: a sharded step issues about a hundred tiny collectives (normalization statistics, gradients
of replicated operands, the loss) and about eighty halo messages of 10-400 KB.  Over gloo on
loopback each costs 0.5-2 ms, mostly thread wake-ups; through shared pages a tiny all-reduce costs
20-50 us (``benchmarks/collective_latency.py``).  All-reduces and all-to-alls larger than a slot
run in rounds of one slot each (the gradient buckets, FFT pencil transposes: an 8 MiB all-to-all
between 2 ranks takes 4.6 ms instead of 11.9 over gloo).  Point-to-point messages larger than a
slot stay on gloo; a small group's message slots are large where ``/dev/shm`` has room (4 MiB
between 2 ranks, 1 MiB among 4: a ring-attention K/V block of the StormCast step, 1.5 MiB, took
1.8 ms to send over gloo and about 0.2 ms through a slot), else 512 KiB.

Each group gets one segment in ``/dev/shm``: a header of counters (each in its own cache line)
and two regions of double-buffered slots.

- Collectives: call ``k`` writes this rank's payload into bank ``k % 2`` of its slot, publishes
  ``k`` in its counter, waits until every peer's counter reaches ``k`` and reads their slots.  A
  rank can only start call ``k + 2`` (overwriting bank ``k % 2``) once every peer published
  ``k + 1``, that is once every peer has read bank ``k % 2``.  Every rank reduces the slots in
  rank order, so the results are bitwise equal.
- All-reduces larger than a slot reduce one slot's worth per call.
- All-to-alls of any size run as a sequence of such calls: in each round a rank writes into its
  slot one block for every peer (a run of whole rows of its piece for that peer, in the same order
  on both sides, because sender and receiver hold pieces of the same shape) and, in a counter of
  the bank's own, whether it has more; the receiver copies its blocks straight into their place in
  its output. So a piece is copied twice (into the slot, out of it) and never packed or
  concatenated, and a round costs two tensor ops per peer (a view and a copy) besides the copies.
- Messages: each ordered pair (sender, receiver) has its own FIFO of two slots, a ``sent`` counter
  written by the sender and a ``consumed`` counter written by the receiver; the sender reuses a
  slot once the receiver has copied out the message that was in it.

A message or collective goes through the channel when it fits its slot; both sides know every
size, so they always agree.  The segment is unlinked once every rank has mapped it, so nothing
is left in ``/dev/shm`` when processes die.  A rank that waits too long, or whose peer process has
exited, raises instead of hanging.  The store ordering the protocol relies on (payload before
counter) holds on x86-64; other architectures, CUDA tensors, non-gloo groups, code traced by
torch.compile (functional collectives) and ``PHYSICS_DP_HOST_CHANNEL=0`` use gloo.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import platform
import secrets
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .manager import DistributedManager
from .tracing import is_tracing

__all__ = [
    "HostChannel",
    "channel_for",
    "open_channel",
    "opened_channel",
    "close_channels",
    "collectives_over_c10d",
    "seconds_waited",
    "SLOT_BYTES",
    "MESSAGE_SLOT_BYTES",
    "ENABLE_ENV_VAR",
]

ENABLE_ENV_VAR = "PHYSICS_DP_HOST_CHANNEL"
SLOT_BYTES = 1024 * 1024  # per rank and collective
MESSAGE_SLOT_BYTES = 512 * 1024  # per ordered pair and message, at least
_MAILBOX_BYTES = 32 * 1024 * 1024  # a small group's message slots together, where /dev/shm has room
_SHM_HEADROOM = 16  # that room: this many times the segment free (Docker's default 64 MB is not)
_BANKS = 2
_MAX_CACHED_VIEWS = 4096  # per channel; a training step uses a few hundred
_COUNTER_STRIDE = 8  # int64 entries between two counters: one cache line each
_MAX_RANKS = 8  # larger groups (several hosts, or unusual) keep gloo
_SHM_DIR = "/dev/shm"
_YIELD_FOR_S = 0.005  # then sleep: a peer this late is computing, not about to arrive
_SLEEP_S = 0.0002
_LIVENESS_EVERY_S = 0.5


class HostChannel:
    """One process group's shared segment, mapped by every rank of the group.

    Its tensors (the slots and their typed views) live as long as the channel and are written in
    place by every later collective, so they are made outside inference mode even when the first
    collective runs inside it: an inference tensor refuses in-place writes outside that mode, so a
    job that evaluated under ``torch.inference_mode()`` first could not train afterwards.
    """

    def __init__(
        self, mapping: mmap.mmap, rank: int, world: int, peer_pids: list[int], timeout_s: float, message_bytes: int
    ) -> None:
        self._mapping = mapping
        self.rank, self.world = rank, world
        self.message_bytes = message_bytes  # the largest point-to-point message a slot holds
        header = _header_bytes(world)
        self._counters = memoryview(mapping)[:header].cast("q")
        collective_bytes = _BANKS * world * SLOT_BYTES
        with torch.inference_mode(False):
            count = _segment_bytes(world, message_bytes) - header
            memory = torch.frombuffer(mapping, dtype=torch.uint8, offset=header, count=count)
            self._banks = memory[:collective_bytes].view(_BANKS, world, SLOT_BYTES)
            self._mailboxes = memory[collective_bytes:].view(world * world * _BANKS, message_bytes)  # [sender][receiver][bank]
        self._typed_banks: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (bank, dtype) -> (world, slot) view
        self._typed_mailboxes: dict[torch.dtype, torch.Tensor] = {}  # dtype -> the mailboxes as rows of that dtype
        self._views: dict[tuple, torch.Tensor] = {}  # see _view
        self._peers = [p for p in range(world) if p != rank]
        self._pids = peer_pids
        self._timeout_s = timeout_s
        self._oversubscribed = _local_ranks() > _usable_cpus()
        self._calls = 0
        self._sent = [0] * world  # messages sent to each peer
        self._posted = [0] * world  # receives posted from each peer

    # counters: one per rank for collectives, then sent[sender][receiver], then consumed[receiver][sender],
    # then more[bank][rank] (an all-to-all round's "more rounds follow", double-buffered like the slots)
    def _collective_counter(self, rank: int) -> int:
        return rank * _COUNTER_STRIDE

    def _sent_counter(self, sender: int, receiver: int) -> int:
        return (self.world + sender * self.world + receiver) * _COUNTER_STRIDE

    def _consumed_counter(self, receiver: int, sender: int) -> int:
        return (self.world + self.world**2 + receiver * self.world + sender) * _COUNTER_STRIDE

    def _more_counter(self, bank: int, rank: int) -> int:
        return (self.world + 2 * self.world**2 + bank * self.world + rank) * _COUNTER_STRIDE

    # ----- collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """A new tensor: the elementwise sum, product, max or min of ``tensor`` over the group's ranks.

        One slot's worth (every small all-reduce: statistics, losses, barriers) is one exchange and
        one reduction, no more tensor ops: each costs microseconds, as much as the exchange itself.
        """
        flat = tensor.reshape(-1)
        per_round = SLOT_BYTES // flat.element_size()
        if flat.numel() <= per_round:
            return _reduce_rows(self._exchange(flat, [flat.numel()] * self.world), reduce_op).view(tensor.shape)
        out = torch.empty_like(flat)
        for start in range(0, flat.numel(), per_round):  # one round per slot's worth
            piece = flat[start : start + per_round]
            _reduce_rows(self._exchange(piece, [piece.numel()] * self.world), reduce_op, out=out[start : start + per_round])
        return out.view(tensor.shape)

    def all_gather(self, flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's 1-D ``flat`` (rank ``p`` holding ``counts[p]`` elements), concatenated in rank order."""
        rows = self._exchange(flat, counts)
        return torch.cat([rows[p, : counts[p]] for p in range(self.world)])

    def gather_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D ``flat`` of one length, as a new (world, length) tensor."""
        return self._exchange(flat, [flat.numel()] * self.world).clone()

    def _exchange(self, flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Publish ``flat``; return the bank as (world, max count) of its dtype once every peer has published."""
        self._calls += 1
        bank = self._typed_bank(self._calls % 2, flat.dtype)
        if flat.numel():
            self._block(bank, self.rank, 0, flat.shape).copy_(flat)
        self._counters[self._collective_counter(self.rank)] = self._calls
        for peer in self._peers:
            self._wait_until(self._collective_counter(peer), self._calls, peer)
        longest = max(counts)
        return self._view((id(bank), longest), lambda: bank[:, :longest])

    def _typed_bank(self, bank: int, dtype: torch.dtype) -> torch.Tensor:
        """Bank ``bank`` as (world, slot) elements of ``dtype``, made once per dtype (a view costs microseconds)."""
        key = (bank, dtype)
        typed = self._typed_banks.get(key)
        if typed is None:
            with torch.inference_mode(False):
                typed = self._typed_banks[key] = self._banks[bank].view(dtype)
        return typed

    def all_to_all(self, sends: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Copy ``sends[p]`` into peer ``p``'s ``outs[self.rank]``; pieces of any size and strides.

        ``outs[p]`` has the shape of peer ``p``'s ``sends[self.rank]`` (and one dtype throughout),
        so both ends cut a piece into the same blocks.  Collective: every rank calls it.
        """
        outs[self.rank].copy_(sends[self.rank])
        region = SLOT_BYTES // (self.world - 1) // 64 * 64
        limit = region // outs[self.rank].element_size()
        to_send = {p: _blocks(sends[p], limit) for p in self._peers}
        to_receive = {p: _blocks(outs[p], limit) for p in self._peers}
        rounds = 0
        while True:
            self._calls += 1
            bank = self._calls % 2
            slots = self._typed_bank(bank, outs[self.rank].dtype)
            for p in self._peers:
                if rounds < len(to_send[p]):
                    block = to_send[p][rounds]
                    self._block(slots, self.rank, self._region_of(p, self.rank, limit), block.shape).copy_(block)
            more = any(rounds + 1 < len(blocks) for blocks in to_send.values())
            self._counters[self._more_counter(bank, self.rank)] = int(more)  # stored before the call's counter
            self._counters[self._collective_counter(self.rank)] = self._calls
            for peer in self._peers:
                self._wait_until(self._collective_counter(peer), self._calls, peer)
            for p in self._peers:
                if rounds < len(to_receive[p]):
                    block = to_receive[p][rounds]
                    block.copy_(self._block(slots, p, self._region_of(self.rank, p, limit), block.shape))
            rounds += 1
            if not any(self._counters[self._more_counter(bank, p)] for p in range(self.world)):
                return

    def _region_of(self, receiver: int, sender: int, region: int) -> int:
        """Offset, in elements of ``sender``'s slot, of the blocks addressed to ``receiver`` (``region`` elements each)."""
        return (receiver if receiver < sender else receiver - 1) * region

    # ----- point-to-point messages ----------------------------------------------------------------
    def send(self, peer: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (any strides) into the next slot towards ``peer`` and publish it.

        Waits only if ``peer`` has not yet copied out the message sent two messages ago.
        """
        self._sent[peer] += 1
        number = self._sent[peer]
        self._wait_until(self._consumed_counter(peer, self.rank), number - _BANKS, peer)
        mailboxes, row = self._mailbox(self.rank, peer, number, tensor.dtype)
        self._block(mailboxes, row, 0, tensor.shape).copy_(tensor)
        self._counters[self._sent_counter(self.rank, peer)] = number

    def post_receive(self, peer: int) -> int:
        """Reserve the next message from ``peer``; pass the returned number to :meth:`receive`."""
        self._posted[peer] += 1
        return self._posted[peer]

    def receive(self, peer: int, number: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Message ``number`` from ``peer``, copied out of its slot (which the sender may then reuse)."""
        self._wait_until(self._sent_counter(peer, self.rank), number, peer)
        mailboxes, row = self._mailbox(peer, self.rank, number, dtype)
        out = self._block(mailboxes, row, 0, shape).clone()
        self._counters[self._consumed_counter(self.rank, peer)] = number
        return out

    def _mailbox(self, sender: int, receiver: int, number: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """The mailboxes as rows of ``dtype`` (made once per dtype), and the row of message ``number`` from ``sender`` to ``receiver``."""
        typed = self._typed_mailboxes.get(dtype)
        if typed is None:
            with torch.inference_mode(False):
                typed = self._typed_mailboxes[dtype] = self._mailboxes.view(dtype)
        return typed, (sender * self.world + receiver) * _BANKS + number % _BANKS

    def _block(self, slots: torch.Tensor, row: int, offset: int, shape: Sequence[int]) -> torch.Tensor:
        """:func:`_block_view` of these arguments, made once (see :meth:`_view`)."""
        return self._view((id(slots), row, offset, tuple(shape)), lambda: _block_view(slots, row, offset, shape))

    def _view(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The view ``make()`` builds, made once per ``key``.

        Why: a step sends the same shapes from the same slots every time, and after a large
        kernel has left the caches cold making the view cost about 5 us of a send and 8-10 of a
        35-45 us receive on the 2-core VM.  Keys hold the slots' identity: typed slots live as
        long as the channel.
        """
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:  # shapes that keep changing (inference at many sizes)
                self._views.clear()
            with torch.inference_mode(False):  # written in place later, maybe outside inference mode
                view = self._views[key] = make()
        return view

    # ----- waiting --------------------------------------------------------------------------------
    def _wait_until(self, index: int, value: int, peer: int) -> None:
        """Return once counter ``index`` (written by ``peer``) reaches ``value``."""
        if self._counters[index] < value:
            self._spin(index, value, peer)

    def _spin(self, index: int, value: int, peer: int) -> None:
        """Spin (yielding the CPU) until the counter moves; sleep once the peer is clearly late."""
        global _seconds_waited
        start = time.monotonic()
        next_check = start + _LIVENESS_EVERY_S
        yield_until = start if self._oversubscribed else start + _YIELD_FOR_S
        try:
            while self._counters[index] < value:
                now = time.monotonic()
                if now < yield_until:
                    os.sched_yield()
                    continue
                time.sleep(_SLEEP_S)
                if now >= next_check:
                    next_check = now + _LIVENESS_EVERY_S
                    self._check_peer(peer, now - start)
        finally:
            _seconds_waited += time.monotonic() - start

    def _check_peer(self, peer: int, waited_s: float) -> None:
        pid = self._pids[peer]
        if pid and not _process_alive(pid):
            raise RuntimeError(
                f"group rank {peer} (pid {pid}) exited while group rank {self.rank} waited for it in a collective "
                "over shared memory; see that rank's error above"
            )
        if waited_s > self._timeout_s:
            raise RuntimeError(
                f"Timed out waiting {self._timeout_s * 1000:.0f}ms: group rank {self.rank} waited for group rank {peer} "
                f"(pid {pid}) in a collective over shared memory; every rank must issue the same collectives in the "
                f"same order (set {ENABLE_ENV_VAR}=0 to use gloo for them)"
            )

    def close(self) -> None:
        """Unmap now if nothing else holds the slots; otherwise the mapping goes with its last tensor."""
        self._counters.release()
        del self._banks, self._mailboxes, self._typed_banks, self._typed_mailboxes
        try:
            self._mapping.close()
        except BufferError:
            pass


def _reduce_rows(rows: torch.Tensor, reduce_op: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum, product, max or min over the ranks' rows (dim 0), in their dtype (integers are not widened)."""
    if reduce_op == "max":
        return torch.amax(rows, 0, out=out)
    if reduce_op == "min":
        return torch.amin(rows, 0, out=out)
    if reduce_op == "product":
        return torch.prod(rows, 0, dtype=rows.dtype, out=out)
    return torch.sum(rows, 0, dtype=rows.dtype, out=out)


def _blocks(piece: torch.Tensor, limit: int) -> list[torch.Tensor]:
    """Views covering ``piece`` in row-major order, each of at most ``limit`` elements: runs of
    whole rows of dim 0, or the blocks of each row where one row is too large."""
    if piece.numel() <= limit:
        return [piece] if piece.numel() else []
    row = piece[0].numel()
    if row <= limit:
        per_block = limit // row
        return [piece.narrow(0, start, min(per_block, len(piece) - start)) for start in range(0, len(piece), per_block)]
    return [block for index in range(len(piece)) for block in _blocks(piece[index], limit)]


def _block_view(slots: torch.Tensor, row: int, offset: int, shape: Sequence[int]) -> torch.Tensor:
    """The elements from ``offset`` of row ``row`` of the typed slots ``slots`` (one row per slot), as a
    contiguous tensor of ``shape``: one ``as_strided``, where slicing and reshaping take three ops."""
    if offset + math.prod(shape) > slots.shape[1]:  # as_strided would write into the next slot unchecked
        raise RuntimeError(f"a block of shape {tuple(shape)} at element {offset} overruns a slot of {slots.shape[1]} elements")
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return slots.as_strided(shape, strides[::-1], slots.storage_offset() + row * slots.stride(0) + offset)


# ----- opening a channel: one handshake over gloo per group -------------------------------------
# weak keys: a channel must not keep its group alive past ``destroy_process_group`` (a gloo group
# destroyed only at interpreter exit aborted the process: a worker thread still joinable)
_channels: weakref.WeakKeyDictionary[ProcessGroup, HostChannel | None] = weakref.WeakKeyDictionary()


def channel_for(group: ProcessGroup, tensor: torch.Tensor, max_bytes: int | None) -> HostChannel | None:
    """The channel of ``group`` for a collective of at most ``max_bytes`` per rank, else None.

    ``max_bytes=None``: an all-reduce or all-to-all, which move any size in rounds.

    Collective on the first eligible call for a group (every rank makes the same call, so every
    rank reaches the handshake); later calls cost a dict lookup.
    """
    too_large = max_bytes is not None and max_bytes > SLOT_BYTES
    if _over_c10d or tensor.device.type != "cpu" or tensor.dtype == torch.bool or too_large or is_tracing():
        return None
    return open_channel(group)


def open_channel(group: ProcessGroup) -> HostChannel | None:
    """The channel of ``group``, opened now if it was not (collective then: every group rank calls it)."""
    if group not in _channels:
        world = dist.get_world_size(group)
        eligible = 1 < world <= _MAX_RANKS and dist.get_backend(group) == "gloo"
        _channels[group] = _open(group) if eligible else None
    return _channels[group]


def opened_channel(group: ProcessGroup, device: torch.device, nbytes: int) -> HostChannel | None:
    """The channel of ``group`` for a message of ``nbytes`` if one is already open, else None.

    Never opens one: a point-to-point call need not be made by every rank of the group.
    """
    if _over_c10d or device.type != "cpu" or is_tracing():
        return None
    channel = _channels.get(group)
    return channel if channel is not None and nbytes <= channel.message_bytes else None


_over_c10d = False
_seconds_waited = 0.0


def seconds_waited() -> float:
    """Seconds this process has spent in host-channel collectives and messages waiting for a peer
    that had not arrived yet (rank drift: the cost of a synchronization beyond its own latency).

    A running total: read it before and after a region.  Waits inside gloo collectives (large
    messages, CUDA, other hosts) are not counted.
    """
    return _seconds_waited


@contextlib.contextmanager
def collectives_over_c10d() -> Iterator[None]:
    """Within the block no collective of this process uses a channel: torch's collectives (c10d)
    carry them all, as they carry every exchange of CUDA tensors.  So CPU ranks can test a GPU
    job's path.  Every rank must be inside the block for the same collectives (a collective
    that one rank sends through a channel and another through c10d would never meet)."""
    global _over_c10d
    previous, _over_c10d = _over_c10d, True
    try:
        yield
    finally:
        _over_c10d = previous


def close_channels() -> None:
    """Unmap every channel (process-group teardown)."""
    for channel in _channels.values():
        if channel is not None:
            channel.close()
    _channels.clear()


def _open(group: ProcessGroup) -> HostChannel | None:
    """Rank 0 creates the segment; every rank maps it and checks a token; all agree or none uses it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    willing = os.environ.get(ENABLE_ENV_VAR, "1") != "0" and platform.machine().lower() in ("x86_64", "amd64")
    path, token, message_bytes = None, secrets.token_hex(16), MESSAGE_SLOT_BYTES
    if rank == 0 and willing:
        path, message_bytes = _create_segment_for(world, token)
    offers: list = [None] * world
    dist.all_gather_object(offers, (path, token, os.getpid(), message_bytes), group=group)
    root_path, root_token, _, message_bytes = offers[0]
    size = _segment_bytes(world, message_bytes)
    mapping = _map_segment(root_path, size, root_token) if willing and root_path else None
    agreed = torch.tensor([1 if mapping is not None else 0], dtype=torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if rank == 0 and path is not None:
        os.unlink(path)  # every rank has mapped it (or given up): the memory lives as long as the mappings
    if not agreed.item():
        if mapping is not None:
            mapping.close()
        return None
    pids = [pid if _process_alive(pid) else 0 for _, _, pid, _ in offers]  # 0: not visible here, not checked
    return HostChannel(mapping, rank, world, pids, DistributedManager().timeout_s, message_bytes)


def _header_bytes(world: int) -> int:
    counters = world + 2 * world**2 + _BANKS * world
    return -(-counters * _COUNTER_STRIDE * 8 // 4096) * 4096


def _segment_bytes(world: int, message_bytes: int) -> int:
    return _header_bytes(world) + _BANKS * world * SLOT_BYTES + world * world * _BANKS * message_bytes


def _message_slot_choices(world: int) -> list[int]:
    """Message slot sizes to try, largest first: the group's share of ``_MAILBOX_BYTES`` (4 MiB
    between 2 ranks, 1 MiB among 4), then ``MESSAGE_SLOT_BYTES``."""
    share = _MAILBOX_BYTES // (world * world * _BANKS) // 4096 * 4096
    return [share, MESSAGE_SLOT_BYTES] if share > MESSAGE_SLOT_BYTES else [MESSAGE_SLOT_BYTES]


def _shm_free_bytes() -> int:
    try:
        stats = os.statvfs(_SHM_DIR)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def _create_segment_for(world: int, token: str) -> tuple[str | None, int]:
    """(path, message slot bytes) of a new segment: large slots only where ``/dev/shm`` keeps
    ``_SHM_HEADROOM`` times the segment free, so that data loaders and other groups sharing it
    still find room."""
    for message_bytes in _message_slot_choices(world):
        size = _segment_bytes(world, message_bytes)
        if message_bytes != MESSAGE_SLOT_BYTES and _shm_free_bytes() < _SHM_HEADROOM * size:
            continue
        path = _create_segment(size, token)
        if path is not None:
            return path, message_bytes
    return None, MESSAGE_SLOT_BYTES


def _create_segment(size: int, token: str) -> str | None:
    if not os.path.isdir(_SHM_DIR):
        return None
    path = os.path.join(_SHM_DIR, f"physics_dp-{token[:12]}-{os.getpid()}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not with SIGBUS on a later write
        os.pwrite(fd, token.encode(), size - len(token))
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path


def _map_segment(path: str, size: int, token: str) -> mmap.mmap | None:
    """Map the segment if it is there and carries ``token`` (so it is the same host's memory)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        mapping = mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    if mapping[size - len(token) :] != token.encode():
        mapping.close()
        return None
    return mapping


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs here and is not a zombie (an exited child its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _local_ranks() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
