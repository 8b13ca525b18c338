"""Batches for one rank of a (data x domain) mesh, prefetched in a background thread.

Every rank draws the same per-epoch permutation (seeded by seed + epoch) and cuts it into global
batches of batch_size * data_size samples; data rank d takes its contiguous share of each. Domain
ranks of one data rank therefore get the same samples (each reading its own hyperslab), and the
union over data ranks of a global batch does not depend on data_size, so a 1x1 and a 2x1 run
train on the same data.  With ``micro_batches`` batches per optimizer step, an epoch holds whole
steps only, so a step trains on the same samples however it is split into micro-batches.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

_STOP_POLL_S = 0.1


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack each key along a new leading batch dim."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class _Failure:
    """An exception raised in the producer thread, carried to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ShardedLoader:
    """Infinite iterator of this data rank's batches; ``state_dict`` records the next batch to yield."""

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int,
        data_rank: int,
        data_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        prefetch: int = 2,
        micro_batches: int = 1,
    ) -> None:
        if batch_size < 1 or data_size < 1 or not 0 <= data_rank < data_size or micro_batches < 1:
            raise ValueError(
                f"batch_size={batch_size}, data_rank={data_rank}, data_size={data_size}, micro_batches={micro_batches}: "
                "need batch_size >= 1, 0 <= data_rank < data_size and micro_batches >= 1"
            )
        if micro_batches > 1 and not drop_last:
            raise ValueError("micro_batches > 1 needs drop_last=True: a short last step would not split into equal micro-batches")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}; use 0 (load in the caller's thread) or more batches ahead")
        self.dataset = dataset
        self.batch_size = batch_size
        self.data_rank = data_rank
        self.data_size = data_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.prefetch = prefetch
        n = len(dataset)
        global_batch = batch_size * data_size
        # batches per epoch: whole steps of micro_batches each
        self.steps_per_epoch = n // (global_batch * micro_batches) * micro_batches if drop_last else -(-n // global_batch)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {n} samples, fewer than one global batch of {global_batch * micro_batches} (batch_size "
                f"{batch_size} x data_size {data_size} x micro_batches {micro_batches}); lower the batch size"
                + (" or use drop_last=False" if micro_batches == 1 else "")
            )
        remainder = n % global_batch
        if not drop_last and 0 < remainder < data_size:
            raise ValueError(
                f"with drop_last=False the last global batch has {remainder} samples for {data_size} data ranks, "
                "so some ranks would get none; use drop_last=True or a batch size that leaves at least one each"
            )
        self.epoch = 0
        self.step = 0
        self._cached_order: tuple[int, torch.Tensor] | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    # ----- sampling -----------------------------------------------------------------------------
    def indices(self, epoch: int, step: int) -> list[int]:
        """Sample indices of this rank's batch at (epoch, step)."""
        order = self._order(epoch)
        global_batch = self.batch_size * self.data_size
        chunk = order[step * global_batch : (step + 1) * global_batch]
        if len(chunk) == global_batch:
            mine = chunk[self.data_rank * self.batch_size : (self.data_rank + 1) * self.batch_size]
        else:  # the short last batch without drop_last: a balanced share each
            mine = torch.tensor_split(chunk, self.data_size)[self.data_rank]
        return mine.tolist()

    def _order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order (kept for the epoch: a permutation of n costs O(n) to draw)."""
        cached = self._cached_order
        if cached is None or cached[0] != epoch:
            n = len(self.dataset)
            if self.shuffle:
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(n)
            cached = self._cached_order = (epoch, order)
        return cached[1]

    def _positions(self, epoch: int, step: int) -> Iterator[tuple[int, int]]:
        while True:
            yield epoch, step
            step += 1
            if step == self.steps_per_epoch:
                epoch, step = epoch + 1, 0

    def _batch(self, epoch: int, step: int) -> dict[str, torch.Tensor]:
        return collate([self.dataset[i] for i in self.indices(epoch, step)])

    # ----- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Batches from the current position on; starting a new iteration stops the previous one."""
        self.close()
        if self.prefetch == 0:
            return self._iter_inline()
        return self._iter_prefetched()

    def _advance(self, epoch: int, step: int) -> None:
        step += 1
        self.epoch, self.step = (epoch + 1, 0) if step == self.steps_per_epoch else (epoch, step)

    def _iter_inline(self) -> Iterator[dict[str, torch.Tensor]]:
        for epoch, step in self._positions(self.epoch, self.step):
            batch = self._batch(epoch, step)
            self._advance(epoch, step)
            yield batch

    def _iter_prefetched(self) -> Iterator[dict[str, torch.Tensor]]:
        stop = threading.Event()
        out: queue.Queue = queue.Queue(maxsize=self.prefetch)
        thread = threading.Thread(target=self._produce, args=(self.epoch, self.step, out, stop), daemon=True)
        self._stop, self._thread = stop, thread
        thread.start()
        try:
            while True:
                item = out.get()
                if isinstance(item, _Failure):
                    raise item.error
                (epoch, step), batch = item
                self._advance(epoch, step)
                yield batch
        finally:
            stop.set()

    def _produce(self, epoch: int, step: int, out: queue.Queue, stop: threading.Event) -> None:
        try:
            for position in self._positions(epoch, step):
                if not self._put(out, (position, self._batch(*position)), stop):
                    return
        except BaseException as error:  # noqa: BLE001  (re-raised in the consumer)
            self._put(out, _Failure(error), stop)

    @staticmethod
    def _put(out: queue.Queue, item: object, stop: threading.Event) -> bool:
        """Queue `item` unless asked to stop first (so close() never waits on a full queue)."""
        while not stop.is_set():
            try:
                out.put(item, timeout=_STOP_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the prefetch thread (the position stays at the next batch not yet yielded)."""
        if self._thread is not None:
            assert self._stop is not None
            self._stop.set()
            self._thread.join()
            self._stop = self._thread = None

    def __enter__(self) -> ShardedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "steps_per_epoch": self.steps_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Continue at a saved position; a running iteration is stopped (iterate again to resume)."""
        if state["seed"] != self.seed or state["steps_per_epoch"] != self.steps_per_epoch:
            raise ValueError(
                f"the loader state was saved with seed={state['seed']}, steps_per_epoch={state['steps_per_epoch']} "
                f"but this loader has seed={self.seed}, steps_per_epoch={self.steps_per_epoch}; resume with the "
                "same dataset, batch size, data-parallel size and seed"
            )
        self.close()
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
