"""Forecast scores: hand-computed values, a brute-force CRPS, the Gaussian closed form, and sharded == one device."""

from __future__ import annotations

import math

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.training.metrics import crps_ensemble, ensemble_spread, rmse


def _random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _crps_pairwise(ensemble: torch.Tensor, truth: torch.Tensor, fair: bool) -> torch.Tensor:
    """The textbook O(E^2) formula, written independently of the sorted form."""
    members = ensemble.shape[0]
    skill = sum((ensemble[i] - truth).abs() for i in range(members)) / members
    pairs = sum((ensemble[i] - ensemble[j]).abs() for i in range(members) for j in range(members))
    return (skill - pairs / (2 * members * (members - 1 if fair else members))).mean(dim=(0, 2, 3))


def test_rmse_by_hand():
    truth = torch.zeros(2, 2, 1, 2, dtype=torch.float64)
    prediction = torch.tensor([[[[3.0, 4.0]], [[1.0, 1.0]]], [[[0.0, 0.0]], [[1.0, -1.0]]]], dtype=torch.float64)
    # channel 0: errors 3, 4, 0, 0 -> sqrt(25 / 4); channel 1: all |1| -> 1
    torch.testing.assert_close(rmse(prediction, truth), torch.tensor([2.5, 1.0], dtype=torch.float64))


def test_rmse_mask_selects_points_and_ignores_nan_outside():
    prediction = _random(3, 2, 4, 5)
    truth = _random(3, 2, 4, 5, seed=1)
    mask = _random(3, 2, 4, 5, seed=2) > 0
    truth_with_nan = torch.where(mask, truth, float("nan"))
    expected = torch.stack([((prediction[:, c] - truth[:, c])[mask[:, c]] ** 2).mean().sqrt() for c in range(2)])
    torch.testing.assert_close(rmse(prediction, truth_with_nan, mask), expected)
    assert rmse(prediction, truth, torch.zeros_like(mask)).isnan().all()


def test_rmse_rejects_bad_inputs():
    field = torch.zeros(1, 2, 3, 3)
    with pytest.raises(ValueError, match="N, C, H, W"):
        rmse(field[0], field[0])
    with pytest.raises(ValueError, match="truth has shape"):
        rmse(field, field[:, :1])
    with pytest.raises(TypeError, match="bool"):
        rmse(field, field, torch.ones_like(field))


def test_spread_of_two_members_by_hand():
    a = torch.full((1, 1, 2, 2), 1.0, dtype=torch.float64)
    ensemble = torch.stack([a, a + 2.0])  # unbiased variance of {1, 3} is 2 everywhere
    torch.testing.assert_close(ensemble_spread(ensemble), torch.tensor([math.sqrt(2.0)], dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2 members"):
        ensemble_spread(ensemble[:1])


def test_crps_of_one_member_is_mae():
    ensemble = _random(1, 2, 3, 4, 5)
    truth = _random(2, 3, 4, 5, seed=1)
    mae = (ensemble[0] - truth).abs().mean(dim=(0, 2, 3))
    torch.testing.assert_close(crps_ensemble(ensemble, truth), mae)
    with pytest.raises(ValueError, match="fair=False"):
        crps_ensemble(ensemble, truth, fair=True)


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("members", [2, 5, 8])
def test_crps_matches_pairwise_formula(members, fair):
    ensemble = _random(members, 2, 3, 4, 5)
    truth = _random(2, 3, 4, 5, seed=1)
    torch.testing.assert_close(crps_ensemble(ensemble, truth, fair=fair), _crps_pairwise(ensemble, truth, fair))


def test_crps_against_gaussian_closed_form():
    """Members ~ N(0, sigma^2), observation 0: CRPS = sigma (sqrt(2) - 1) / sqrt(pi).

    The fair score estimates it without bias; the plain one exceeds it by sigma / (E sqrt(pi)).
    """
    members, sigma = 16, torch.tensor([1.0, 3.0], dtype=torch.float64)
    ensemble = _random(members, 4, 2, 32, 32) * sigma.reshape(1, 1, 2, 1, 1)
    truth = torch.zeros(4, 2, 32, 32, dtype=torch.float64)
    exact = sigma * (math.sqrt(2.0) - 1.0) / math.sqrt(math.pi)
    torch.testing.assert_close(crps_ensemble(ensemble, truth, fair=True), exact, rtol=0.02, atol=0.0)
    plain_excess = sigma / (members * math.sqrt(math.pi))
    torch.testing.assert_close(crps_ensemble(ensemble, truth), exact + plain_excess, rtol=0.02, atol=0.0)


def test_crps_rejects_mismatched_truth():
    with pytest.raises(ValueError, match="one ensemble member"):
        crps_ensemble(torch.zeros(3, 1, 2, 4, 4), torch.zeros(1, 2, 4, 5))


def _sharded_scores(height_split: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Every score sharded over H (split ``height_split``) and on one device, with the bytes this rank sent."""
    mesh = get_mesh((2,), ("domain",))
    ensemble = _random(4, 2, 3, sum(height_split), 6)
    truth = _random(2, 3, sum(height_split), 6, seed=1)
    mask = _random(2, 3, sum(height_split), 6, seed=2) > -0.5
    sizes = {0: height_split}
    sharded_ensemble = distribute_tensor(ensemble, mesh, [Shard(3)], sharding_sizes=sizes)
    sharded_truth = distribute_tensor(truth, mesh, [Shard(2)], sharding_sizes=sizes)
    sharded_mask = distribute_tensor(mask, mesh, [Shard(2)], sharding_sizes=sizes)
    scores = {
        "rmse": lambda e, t, m: rmse(e[0], t),
        "rmse_masked": lambda e, t, m: rmse(e[1], t, m),
        "spread": lambda e, t, m: ensemble_spread(e),
        "crps": lambda e, t, m: crps_ensemble(e, t),
        "crps_fair": lambda e, t, m: crps_ensemble(e, t, fair=True),
    }
    results = {}
    for name, score in scores.items():
        with count_communication() as log:
            sharded = score(sharded_ensemble, sharded_truth, sharded_mask)
        assert isinstance(sharded, ShardTensor), name
        results[name] = (sharded.full_tensor(), score(ensemble, truth, mask), log.bytes_sent)
    return results


@pytest.mark.parametrize("height_split", [[4, 3], [6, 1]])
def test_sharded_over_h_matches_one_device(height_split):
    per_rank = run_on_ranks(2, _sharded_scores, height_split)
    for rank_results in per_rank:
        for name, (sharded, single, bytes_sent) in rank_results.items():
            torch.testing.assert_close(sharded, single, msg=f"{name} differs from one device")
            # only per-channel sums cross ranks (one all-reduce; two with a mask), never the fields
            assert 0 < bytes_sent <= 2 * single.numel() * single.element_size(), (name, bytes_sent)
