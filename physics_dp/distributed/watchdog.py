"""A watchdog that ends every rank, with a message naming the culprit, when one rank goes silent.

Why: a rank stopped by SIGSTOP, swapped out or on a lost node leaves its peers blocked in a
collective that says nothing until the process-group timeout, and then only "Timed out waiting
for recv". Here each rank bumps a counter in a small TCPStore (hosted by rank 0, separate from
the process group's) from a background thread; a second thread watches every peer's counter and,
when one has not moved for half of ``timeout_s`` (so before the process group's own timeout of
``timeout_s`` gives a bare "Timed out waiting"), prints who went silent (rank, host, pid) and ends this
rank. A silent peer on the same host is killed too (a stopped process cannot end itself), so the
whole job ends instead of the launcher waiting on it. Threads keep beating while the main thread
computes or waits, so a slow step is never mistaken for a stall.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["WATCHDOG_EXIT_CODE", "Watchdog"]

WATCHDOG_EXIT_CODE = 75
_JOIN_GRACE_S = 1.0  # how long past one beat a stopping watchdog waits for its threads


class Watchdog:
    """Collective to start and stop; ``timeout_s / 2`` of silence from any rank ends every rank."""

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout_s={timeout_s}: must be > 0 (parallel.timeout_s)")
        self.timeout_s = float(timeout_s)
        self.silence_s = self.timeout_s / 2
        self.interval_s = min(max(self.silence_s / 10, 0.1), 5.0)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: dist.TCPStore | None = None  # rank 0's, hosting every rank's counter

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Collective over the world: rank 0 hosts the store, every rank starts its two threads."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        box: list[object] = [None]
        if rank == 0:
            self._server = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            box[0] = (os.environ.get("MASTER_ADDR") or socket.gethostname(), self._server.port)
        dist.broadcast_object_list(box, src=0)
        host, port = box[0]  # type: ignore[misc]
        store = self._server if rank == 0 else dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        store.set(f"beat/{rank}", "0")
        peers: list[object] = [None] * world
        dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
        self._state = {"counts": [0] * world, "changed": [time.monotonic()] * world, "store_ok": time.monotonic()}
        self._threads = [
            threading.Thread(target=self._beat, args=(store, rank, world), name="physics_dp-heartbeat", daemon=True),
            threading.Thread(target=self._watch, args=(rank, peers), name="physics_dp-watchdog", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop watching, and close rank 0's store now (local; peers stopping later do not mind: they
        stop watching too).

        The threads are joined and the server dropped here, at the end of the job's run, not by the
        garbage collector at some later point, when its native threads would shut down in the middle
        of the next run's collectives.  A thread still blocked in the store after one more beat is
        left to end on its own (it is a daemon).
        """
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.interval_s + _JOIN_GRACE_S)
        self._threads = []
        self._server = None

    def _beat(self, store: dist.TCPStore, rank: int, world: int) -> None:
        keys = [f"beat/{r}" for r in range(world)]
        while not self._stop.wait(self.interval_s):
            try:
                store.add(keys[rank], 1)
                counts = [int(v) for v in store.multi_get(keys)]
            except Exception:  # the store host is gone or silent: the watcher judges by store_ok's age
                continue
            now = time.monotonic()
            for r, count in enumerate(counts):
                if count != self._state["counts"][r]:
                    self._state["counts"][r] = count
                    self._state["changed"][r] = now
            self._state["store_ok"] = now

    def _watch(self, rank: int, peers: list) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            silent = [(now - t, r) for r, t in enumerate(self._state["changed"]) if r != rank]
            if now - self._state["store_ok"] > self.silence_s:
                silent.append((now - self._state["store_ok"], 0))  # rank 0 hosts the store
            stalled = [(age, r) for age, r in silent if age > self.silence_s]
            if stalled and not self._stop.is_set():
                self._end(rank, peers, max(stalled)[1], max(stalled)[0])

    def _end(self, rank: int, peers: list, culprit: int, age: float) -> None:
        host, pid = peers[culprit]
        message = (
            f"[physics_dp watchdog] rank {rank}: rank {culprit} (host {host}, pid {pid}) has shown no sign of life for "
            f"{age:.0f} s (parallel.timeout_s={self.timeout_s:g}); it is stopped (SIGSTOP), hung outside Python, or its "
            f"node is gone. Ending rank {rank}."
        )
        print(message, file=sys.stderr, flush=True)  # not logging: it must show even where logging is off
        if host == socket.gethostname() and pid != os.getpid():
            try:  # a stopped process cannot end itself; the launcher would wait for it
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(WATCHDOG_EXIT_CODE)
