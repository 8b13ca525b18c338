"""Errors that every rank learns about: one rank's failure becomes the same error on all ranks.

Why: when only rank 0 fails (its filesystem work, a lock, a file it alone reads) and the others go
on into the next collective, they fail later with gloo's "Connection closed by peer" or wait for
the collective timeout. Routing such work through these helpers makes every rank raise the very
exception the failing rank raised, at the same point, with the failing rank named.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["on_rank0", "raise_together"]

T = TypeVar("T")


def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _portable(error: BaseException, rank: int) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError carrying its type and message."""
    try:
        restored = pickle.loads(pickle.dumps(error))
    except Exception:  # exceptions with unusual constructors do not unpickle
        restored = RuntimeError(f"{type(error).__name__}: {error}")
    if hasattr(restored, "add_note"):
        restored.add_note(f"(raised on rank {rank})")
    return restored


def raise_together(error: BaseException | None) -> None:
    """Collective over the world: if any rank passes an error, every rank raises the error of the
    lowest failing rank (a failing rank re-raises its own, with its traceback)."""
    if not _world():
        if error is not None:
            raise error
        return
    rank = dist.get_rank()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if error is None else _portable(error, rank))
    failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if not failed:
        return
    if error is not None:
        raise error
    raise failed[0][1]


def on_rank0(action: Callable[[], T]) -> T:
    """Collective: run ``action`` on rank 0 only; every rank returns its result or raises its error."""
    if not _world():
        return action()
    box: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = action()
        except Exception as error:  # re-raised below on every rank
            box[1] = _portable(error, 0)
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]
