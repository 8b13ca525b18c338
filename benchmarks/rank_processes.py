"""Fresh rank processes for the benchmark scripts: spawn them, join one job, run a body, collect.

Why one module: each script used to carry its own spawn code, and the ones that waited on a queue
hung for good when a rank died before putting its result there.  Here
``torch.multiprocessing.spawn`` watches every rank: one that raises or dies ends the run with its
error, and the others are terminated.

Each rank plays the part torchrun would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, a free port on
127.0.0.1), runs on one thread, joins the job through ``DistributedManager`` (gloo on CPU, NCCL on
GPUs), runs the body, and all-gathers the bodies' return values; rank 0 writes them to a file the
parent reads.  ``DistributedManager().cleanup()`` then tears the job down.  A rank that raises leaves at once,
without the teardown's wait for its peers, so its own traceback is the error the run reports.

After every result is in, torch's process-group teardown at interpreter exit occasionally aborts
a rank ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489).  The
measurement is complete by then, so :func:`run_ranks` keeps the results and says so on stderr
instead of failing the run.  A rank that dies before every result is in still fails it.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from physics_dp.testing import free_port

__all__ = ["run_ranks"]


def run_ranks(world: int, body: Callable[..., Any], *args: Any, backend: str | None = None) -> list[Any]:
    """``body(*args)`` on ``world`` new rank processes of one job, one thread each: every rank's
    return value, in rank order.  ``body`` and its arguments must be picklable (module-level).

    ``backend``: the process group's (default: ``DistributedManager``'s choice for the device).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.pkl")
        try:
            mp.spawn(_rank_entry, args=(world, free_port(), body, args, backend, out_path), nprocs=world, join=True)
        except mp.ProcessExitedException as exited:
            if exited.signal_name is None or not os.path.exists(out_path):
                raise
            print(f"warning: rank {exited.error_index} was killed by {exited.signal_name} while tearing down, after "
                  "every rank delivered its result; the results are kept", file=sys.stderr, flush=True)
        with open(out_path, "rb") as handle:
            return pickle.load(handle)


def _rank_entry(
    rank: int, world: int, port: int, body: Callable[..., Any], args: tuple, backend: str | None, out_path: str
) -> None:
    """``torch.multiprocessing.spawn`` target: join the job, run ``body``, rank 0 writes every result."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from physics_dp.distributed import DistributedManager

    DistributedManager.initialize(backend=backend)
    result = body(*args)  # an error leaves without tearing down: peers are terminated, and its traceback reported
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:  # written whole, then renamed: the parent never reads a partial file
        with open(f"{out_path}.part", "wb") as handle:
            pickle.dump(gathered, handle)
        os.replace(f"{out_path}.part", out_path)
    DistributedManager().cleanup()
