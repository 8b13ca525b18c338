"""ShardedLoader: per-epoch permutations, data-parallel invariance, resume, prefetch thread behaviour."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from physics_dp.data import ShardedLoader, WeatherDataset


class Numbers(torch.utils.data.Dataset):
    """Sample i is {"x": i}: batches show exactly which samples a rank got. Optionally fails at one index."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.fail_at:
            raise RuntimeError(f"cannot read sample {i}")
        return {"x": torch.tensor(i), "pair": torch.tensor([i, -i])}


def take(loader: ShardedLoader, n: int) -> list[list[int]]:
    return [batch["x"].tolist() for batch in itertools.islice(iter(loader), n)]


def test_each_epoch_is_a_seeded_permutation():
    loader = ShardedLoader(Numbers(12), batch_size=4, data_rank=0, data_size=1, seed=7)
    assert loader.steps_per_epoch == 3
    batches = take(loader, 6)
    first, second = sum(batches[:3], []), sum(batches[3:], [])
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second and first != list(range(12))
    again = ShardedLoader(Numbers(12), batch_size=4, data_rank=0, data_size=1, seed=7, prefetch=0)
    assert take(again, 6) == batches
    other = ShardedLoader(Numbers(12), batch_size=4, data_rank=0, data_size=1, seed=8)
    assert take(other, 3) != batches[:3]
    ordered = ShardedLoader(Numbers(12), batch_size=4, data_rank=0, data_size=1, seed=7, shuffle=False)
    assert take(ordered, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]
    loader.close()


@pytest.mark.parametrize("data_size,micro_batches", [(1, 2), (2, 3)])
def test_a_step_trains_on_the_same_samples_however_it_is_split(data_size, micro_batches):
    """An epoch of micro-batches holds whole steps (23 samples, steps of 6: three steps, five samples
    dropped), so each step's micro-batches over every data rank are the unsplit step's samples."""
    dataset = Numbers(23)
    single = ShardedLoader(dataset, batch_size=6, data_rank=0, data_size=1, seed=1)
    micro = 6 // (data_size * micro_batches)
    ranks = [ShardedLoader(dataset, micro, d, data_size, seed=1, micro_batches=micro_batches) for d in range(data_size)]
    assert ranks[0].steps_per_epoch == 3 * micro_batches
    expected = take(single, 7)  # across two epoch boundaries
    per_rank = [take(loader, 7 * micro_batches) for loader in ranks]
    for step in range(7):
        batches = range(step * micro_batches, (step + 1) * micro_batches)
        assert sorted(sum((per_rank[d][b] for d in range(data_size) for b in batches), [])) == sorted(expected[step])
    with pytest.raises(ValueError, match="needs drop_last=True"):
        ShardedLoader(dataset, 2, 0, 1, seed=1, drop_last=False, micro_batches=2)


@pytest.mark.parametrize("data_size", [2, 3])
def test_global_batch_is_the_same_for_any_data_parallel_size(data_size):
    dataset = Numbers(23)  # not divisible: drop_last drops the same samples either way
    single = ShardedLoader(dataset, batch_size=6, data_rank=0, data_size=1, seed=1)
    ranks = [ShardedLoader(dataset, batch_size=6 // data_size, data_rank=d, data_size=data_size, seed=1) for d in range(data_size)]
    expected = take(single, 9)
    per_rank = [take(loader, 9) for loader in ranks]
    for step in range(9):
        assert sum((per_rank[d][step] for d in range(data_size)), []) == expected[step]
        assert all(len(per_rank[d][step]) == 6 // data_size for d in range(data_size))


def test_domain_ranks_of_one_data_rank_read_the_same_samples(synthetic_spec):
    """Two domain ranks: same data rank, different row windows; their batches tile the whole-grid batch."""
    whole = WeatherDataset(synthetic_spec)
    halves = [WeatherDataset(synthetic_spec, rows=rows, stats=whole.stats) for rows in ((0, 11), (11, 21))]
    loaders = [ShardedLoader(ds, batch_size=2, data_rank=1, data_size=2, seed=3) for ds in [whole, *halves]]
    full, top, bottom = (next(iter(loader)) for loader in loaders)
    assert full["state"].shape == (2, 3, 21, 30) and full["time_index"].shape == (2,)
    assert torch.equal(full["time_index"], top["time_index"]) and torch.equal(top["time_index"], bottom["time_index"])
    for key in ("state", "target", "mask", "background", "invariants"):
        assert torch.equal(torch.cat([top[key], bottom[key]], dim=2), full[key]), key
    for loader in loaders:
        loader.close()
        loader.dataset.close()


def test_resume_continues_with_the_next_batch():
    reference = take(ShardedLoader(Numbers(10), batch_size=3, data_rank=0, data_size=1, seed=5), 8)
    loader = ShardedLoader(Numbers(10), batch_size=3, data_rank=0, data_size=1, seed=5, prefetch=3)
    seen = take(loader, 4)  # crosses the epoch boundary (3 steps per epoch) while more are prefetched
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["step"] == 1
    loader.close()
    resumed = ShardedLoader(Numbers(10), batch_size=3, data_rank=0, data_size=1, seed=5)
    resumed.load_state_dict(state)
    assert seen + take(resumed, 4) == reference
    with pytest.raises(ValueError, match="saved with seed=5.*resume with the same"):
        ShardedLoader(Numbers(10), batch_size=3, data_rank=0, data_size=1, seed=6).load_state_dict(state)


def test_without_drop_last_the_short_batch_is_shared():
    single = take(ShardedLoader(Numbers(10), batch_size=4, data_rank=0, data_size=1, seed=2, drop_last=False), 3)
    ranks = [take(ShardedLoader(Numbers(10), batch_size=2, data_rank=d, data_size=2, seed=2, drop_last=False), 3) for d in (0, 1)]
    assert [len(b) for b in single] == [4, 4, 2]
    assert ranks[0][2] + ranks[1][2] == single[2] and len(ranks[0][2]) == 1
    assert sorted(sum(single, [])) == list(range(10))
    with pytest.raises(ValueError, match="last global batch has 1 samples for 2 data ranks"):
        ShardedLoader(Numbers(9), batch_size=2, data_rank=0, data_size=2, seed=0, drop_last=False)


def test_errors_in_the_prefetch_thread_reach_the_caller():
    loader = ShardedLoader(Numbers(8, fail_at=5), batch_size=2, data_rank=0, data_size=1, seed=0, shuffle=False)
    iterator = iter(loader)
    assert next(iterator)["x"].tolist() == [0, 1]
    next(iterator)
    with pytest.raises(RuntimeError, match="cannot read sample 5"):
        next(iterator)
    loader.close()


def test_close_stops_the_thread_and_iterating_again_restarts_at_the_position():
    loader = ShardedLoader(Numbers(8), batch_size=2, data_rank=0, data_size=1, seed=0, shuffle=False, prefetch=2)
    before = set(threading.enumerate())
    iterator = iter(loader)
    assert next(iterator)["pair"].tolist() == [[0, 0], [1, -1]]
    started = set(threading.enumerate()) - before
    assert len(started) == 1
    loader.close()
    assert not any(thread.is_alive() for thread in started)
    assert take(loader, 2) == [[2, 3], [4, 5]]
    loader.close()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="fewer than one global batch of 8"):
        ShardedLoader(Numbers(5), batch_size=4, data_rank=0, data_size=2, seed=0)
    with pytest.raises(ValueError, match="0 <= data_rank < data_size"):
        ShardedLoader(Numbers(5), batch_size=1, data_rank=2, data_size=2, seed=0)
    with pytest.raises(ValueError, match="prefetch=-1"):
        ShardedLoader(Numbers(5), batch_size=1, data_rank=0, data_size=1, seed=0, prefetch=-1)
