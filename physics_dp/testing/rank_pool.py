"""Run a function on every rank of a persistent pool of real processes.

Why a persistent pool: the test suite runs hundreds of distributed cases at world sizes 1-4.
Starting processes (each fresh interpreter imports torch) and a gloo rendezvous costs seconds per
world size; paying that once per session and then shipping tasks over pipes makes a case cost
well under a millisecond.

Why forkserver: spawn re-imports torch in every worker (about 2.5 s of CPU each, 7 s for a
4-rank pool on 2 cores). The forkserver is a fresh interpreter that imports torch once (and runs
no torch op, so no OpenMP pool exists) and forks workers from itself, so later pools start in under 0.1 s. It is as safe as spawn
for the reason spawn is usually chosen: workers are never forked from the test process, whose
OpenMP threads would be broken by fork. Set PHYSICS_DP_RANK_POOL_START=spawn to use spawn.

Why it kills instead of waiting: a rank that raises leaves its peers blocked in a collective
forever. The pool gives the survivors a short grace period, dumps the stacks of the ones still
stuck, kills every worker and reports all of it; the next call starts a fresh pool.

Why workers write to files: a worker's stdout and stderr (file descriptors 1 and 2, so C++ too)
go to one file per rank. What a task wrote is copied to the caller's stderr after the task, with
the rank in front of each line, so pytest shows it with the test that wrote it; a native crash's
own words (``terminate called after throwing ...``) come back in the failure's message.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing import connection, get_all_start_methods, get_context
from multiprocessing.context import BaseContext
from multiprocessing.connection import Connection
from typing import Any

STARTUP_TIMEOUT_S = 180.0
FAILURE_GRACE_S = 2.5
STACK_DUMP_WAIT_S = 1.0
OUTPUT_TAIL_CHARS = 6000  # of a failed rank's output, in the failure's message
WORKER_PG_TIMEOUT_S = 300.0

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
START_METHOD_ENV_VAR = "PHYSICS_DP_RANK_POOL_START"
_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class RankFailure(RuntimeError):
    """A distributed task failed: some ranks raised, died, or did not finish in time.

    ``errors`` maps rank -> remote traceback text, ``stuck`` lists ranks that never answered,
    ``stacks`` maps stuck rank -> its Python stacks dumped just before the pool was killed.
    """

    def __init__(self, message: str, errors: dict[int, str], stuck: list[int], stacks: dict[int, str]):
        super().__init__(message)
        self.errors = errors
        self.stuck = stuck
        self.stacks = stacks


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any) -> list:
    """Call ``fn(*args, **kwargs)`` on every rank of a ``world_size`` pool; return results in rank order.

    ``fn`` must be importable by reference (a module-level function, also in a pytest module),
    and arguments and results must pickle (CPU tensors do). The pool for ``world_size`` is
    started on first use and reused for the rest of the process, so a case costs milliseconds
    rather than a process start plus rendezvous. Raises ``RankFailure`` if any rank raises, dies,
    or does not finish within ``timeout`` seconds; the pool is then replaced transparently.
    """
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=_PICKLE_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"run_on_ranks needs a picklable task (fn must be a module-level function): {exc}"
        ) from exc
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _RankPool(world_size)
    try:
        return pool.run(payload, timeout)
    except BaseException:
        # After a RankFailure the pool is dead already; after anything else (Ctrl-C) its workers may
        # still be busy with this task and would answer the next one out of turn.
        _POOLS.pop(world_size, None)
        pool.kill()
        raise


def shutdown_pools() -> None:
    """Stop every pool; registered at exit, callable earlier to free the processes."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()


def get_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """Inside a rank function: a DeviceMesh of ``shape`` over the pool.

    ``build_device_mesh`` keeps one mesh per (shape, names), so hundreds of cases share a handful
    of process groups. Default names follow ``physics_dp.distributed.default_axis_names``. Every
    rank must call it (it is collective the first time).
    """
    from physics_dp.distributed import build_device_mesh

    return build_device_mesh(tuple(shape), None if names is None else tuple(names))


_POOLS: dict[int, _RankPool] = {}
atexit.register(shutdown_pools)


class _RankPool:
    """``world_size`` worker processes, one duplex pipe each, sharing one gloo process group."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.stack_dir = tempfile.mkdtemp(prefix=f"physics_dp_ranks{world_size}_")
        self.processes: list = []
        self.conns: list[Connection] = []
        self._output_read = [0] * world_size  # bytes of each rank's output file already passed on
        self._sent_sys_path: list[str] = list(sys.path)
        self._start()

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        with _patched_environ(_THREAD_ENV):
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                process = ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, port, child_end, self._stack_file(rank), self._output_file(rank)),
                    name=f"physics_dp-rank{rank}of{self.world_size}",
                    daemon=False,  # rank functions may start their own children (data loader workers)
                )
                process.start()
                child_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)
        # The ready message doubles as a first task: it proves every rank finished the rendezvous.
        _, errors, stuck = self._collect(STARTUP_TIMEOUT_S, set(range(self.world_size)))
        if errors or stuck:
            self._fail(errors, stuck, f"starting a pool of {self.world_size} ranks", STARTUP_TIMEOUT_S)
        self._pass_on_output()

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self.stack_dir, f"rank{rank}.stacks")

    def _output_file(self, rank: int) -> str:
        return os.path.join(self.stack_dir, f"rank{rank}.output")

    def _new_output(self) -> dict[int, str]:
        """What each rank wrote since the last call (ranks that wrote nothing are left out)."""
        written: dict[int, str] = {}
        for rank in range(self.world_size):
            try:
                with open(self._output_file(rank), "rb") as handle:
                    handle.seek(self._output_read[rank])
                    data = handle.read()
            except FileNotFoundError:
                continue
            self._output_read[rank] += len(data)
            if data:
                written[rank] = data.decode(errors="replace")
        return written

    def _pass_on_output(self) -> None:
        for rank, text in self._new_output().items():
            sys.stderr.write("".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True)))
            if not text.endswith("\n"):
                sys.stderr.write("\n")

    def run(self, payload: bytes, timeout: float) -> list:
        path = list(sys.path)
        header = path if path != self._sent_sys_path else None
        self._sent_sys_path = path
        message = pickle.dumps((header, payload), protocol=_PICKLE_PROTOCOL)
        errors: dict[int, str] = {}
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError as exc:
                errors[rank] = f"could not send the task: {exc!r} (worker exit code {self.processes[rank].exitcode})"
        pending = set(range(self.world_size)) - set(errors)
        answers, late_errors, stuck = self._collect(timeout, pending, failed_already=bool(errors))
        errors.update(late_errors)
        if errors or stuck:
            self._fail(errors, stuck, "running the task", timeout)
        self._pass_on_output()
        return [answers[rank] for rank in range(self.world_size)]

    def _collect(
        self, timeout: float, pending: set[int], failed_already: bool = False
    ) -> tuple[dict[int, Any], dict[int, str], list[int]]:
        """Wait for one answer per pending rank; once any rank has failed, wait only a grace period."""
        answers: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + (min(timeout, FAILURE_GRACE_S) if failed_already else timeout)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = {}
            for rank in pending:
                waitables[self.conns[rank]] = rank
                waitables[self.processes[rank].sentinel] = rank
            for ready in connection.wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                pending.discard(rank)
                ok, value = self._receive(rank)
                if ok:
                    answers[rank] = value
                else:
                    errors[rank] = value
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return answers, errors, sorted(pending)

    def _receive(self, rank: int) -> tuple[bool, Any]:
        conn = self.conns[rank]
        try:
            if not conn.poll():  # only the sentinel fired: the worker is gone without answering
                raise EOFError
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self.processes[rank].join(0.5)
            message = f"{_DIED} (exit code {self.processes[rank].exitcode})"
            try:  # what faulthandler wrote at the crash, if the worker got as far as opening the file
                with open(self._stack_file(rank)) as handle:
                    crash = handle.read().strip()
            except FileNotFoundError:
                crash = "(it died before it could record stacks)"
            return False, f"{message}\n{crash}" if crash else message

    def _fail(self, errors: dict[int, str], stuck: list[int], what: str, timeout: float) -> None:
        stacks = self._dump_stacks(stuck)
        output = self._new_output()  # before kill(), which deletes the files
        self.kill()
        lines = [f"{what} on {self.world_size} ranks failed"]
        if errors:
            lines[0] += f": rank(s) {sorted(errors)} raised or died"
        if stuck:
            reason = f"within {FAILURE_GRACE_S} s after the failure" if errors else f"within the timeout of {timeout} s"
            lines.append(f"rank(s) {stuck} did not finish {reason} (likely blocked in a collective); the pool was killed")
        for rank in sorted(errors):
            lines.append(f"\n----- rank {rank} -----\n{errors[rank].rstrip()}")
        for rank in sorted(stacks):
            lines.append(f"\n----- rank {rank} stacks when killed -----\n{stacks[rank].rstrip()}")
        for rank in sorted(output):
            tail = output[rank][-OUTPUT_TAIL_CHARS:]
            cut = " (its end)" if len(tail) < len(output[rank]) else ""
            lines.append(f"\n----- rank {rank} stdout and stderr during the task{cut} -----\n{tail.rstrip()}")
        if errors:  # last, so a log cut in the middle (CI excerpts) still shows what happened
            lines.append("\n----- in short -----")
            lines.extend(f"rank {rank}: {_gist(errors[rank])}" for rank in sorted(errors))
        raise RankFailure("\n".join(lines), errors, stuck, stacks)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        if not ranks or not hasattr(signal, "SIGUSR1"):
            return {}
        for rank in ranks:
            if self.processes[rank].is_alive():
                os.kill(self.processes[rank].pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        stacks: dict[int, str] = {}
        while len(stacks) < len(ranks) and time.monotonic() < deadline:
            time.sleep(0.02)
            for rank in ranks:
                with open(self._stack_file(rank)) as handle:
                    text = handle.read()
                if text.rstrip().endswith("<module>"):  # the outermost frame of the main thread: dump complete
                    stacks[rank] = text
        for rank in ranks:
            if rank not in stacks:
                with open(self._stack_file(rank)) as handle:
                    stacks[rank] = handle.read() or "(no stacks written)"
        return stacks

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(5)
        self._close()

    def shutdown(self) -> None:
        """Ask workers to leave cleanly; kill whatever has not left within a second."""
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns = []
        shutil.rmtree(self.stack_dir, ignore_errors=True)


def _context() -> BaseContext:
    method = os.environ.get(START_METHOD_ENV_VAR)
    if method is None:
        method = "forkserver" if "forkserver" in get_all_start_methods() else "spawn"
    ctx = get_context(method)
    if method == "forkserver":
        # pytest too when running under it: every worker imports the test modules, which import pytest.
        preload = ["torch", "physics_dp.distributed", __name__]
        ctx.set_forkserver_preload(preload + ["pytest"] * ("pytest" in sys.modules))
    return ctx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a job's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _patched_environ(values: dict[str, str]) -> Iterator[None]:
    """Children (and the forkserver) copy os.environ when started: thread limits must precede importing torch."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _gist(error: str) -> str:
    """One line of a rank's error: the exception a traceback ends with, or for a dead worker its
    exit code's signal, faulthandler's verdict and the crashing thread's innermost frames."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    if not lines[0].startswith(_DIED):
        return lines[-1]
    parts = [lines[0]]
    code = re.search(r"exit code (-\d+)", lines[0])
    if code:
        with suppress(ValueError):
            parts.append(signal.Signals(-int(code.group(1))).name)
    parts += [line for line in lines if line.startswith("Fatal Python error")][:1]
    current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    if current is not None:
        frames = [_FRAME.sub(r"\1:\2 \3", line) for line in lines[current + 1 : current + 1 + _GIST_FRAMES]]
        parts.append("crashing thread at " + " < ".join(frames))
    return "; ".join(parts)


_DIED = "worker process died"  # how _receive's message for a dead worker begins, which _gist reads
_FRAME = re.compile(r'File "(?:.*/)?([^/"]+)", line (\d+) in (\S+)')  # a faulthandler frame, compacted
_GIST_FRAMES = 4


def _worker_main(rank: int, world_size: int, port: int, conn: Connection, stack_file: str, output_file: str) -> None:
    """Entry point of one rank: join the process group once, then serve tasks until told to stop."""
    _write_output_to(output_file)
    stacks = open(stack_file, "w")  # kept open: faulthandler writes to its descriptor on SIGUSR1
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)  # a crash (SIGSEGV, abort) leaves its stacks there
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    os.environ.update(
        _THREAD_ENV,
        CUDA_VISIBLE_DEVICES="",  # CPU harness; set before anything initializes CUDA
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        import torch

        from physics_dp.distributed import DistributedManager

        torch.set_num_threads(1)
        DistributedManager.initialize(backend="gloo", timeout=WORKER_PG_TIMEOUT_S)
        reply = (True, None)
    except BaseException:
        reply = (False, traceback.format_exc())
    conn.send_bytes(pickle.dumps(reply, protocol=_PICKLE_PROTOCOL))
    if not reply[0]:
        return
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if message is None:
            break
        conn.send_bytes(_serve(message))
    DistributedManager().cleanup()


def _write_output_to(path: str) -> None:
    """Point file descriptors 1 and 2 at ``path``: Python's prints and warnings and C++'s messages alike."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    sys.stdout.reconfigure(line_buffering=True)  # a crash must not lose lines waiting in a buffer


def _serve(message: tuple[list[str] | None, bytes]) -> bytes:
    path, payload = message
    if path is not None:
        sys.path[:] = path
    try:
        fn, args, kwargs = pickle.loads(payload)
        return pickle.dumps((True, fn(*args, **kwargs)), protocol=_PICKLE_PROTOCOL)
    except BaseException:
        return pickle.dumps((False, traceback.format_exc()), protocol=_PICKLE_PROTOCOL)


def _exit_with_parent(parent_pid: int) -> None:
    """An orphaned worker may be blocked in a collective and never read EOF; leave when the parent is gone."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)
