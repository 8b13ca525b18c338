"""Layout-independent noise: exact values, sane statistics, and sharded == single device on every layout."""

from __future__ import annotations

import math

import pytest
import torch

from physics_dp.diffusion import derive_seed, randn_like_global, sample_sigma_lognormal
from physics_dp.diffusion.noise import _FIELD_STREAM, _stream_keys
from physics_dp.distributed.collectives import count_communication
from physics_dp.shard_tensor import Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

M64 = (1 << 64) - 1


def _splitmix_reference(state: int) -> int:
    z = state & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _reference_value(seed: int, sample: int, position: int) -> float:
    """One noise value computed with Python integers and math only (checks the int64 tensor hash)."""
    key = _stream_keys(seed, _FIELD_STREAM, [sample])[0]
    z = _splitmix_reference(key + position * 0x9E3779B97F4A7C15)
    u1 = ((z >> 32) + 0.5) * 2.0**-32
    u2 = (z & 0xFFFFFFFF) * 2.0**-32
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def test_values_match_integer_reference():
    like = torch.empty(2, 3, 5, 7, dtype=torch.float64)
    noise = randn_like_global(like, seed=11, sample_ids=[4, 9])
    for n, sample in enumerate([4, 9]):
        for c, h, w in [(0, 0, 0), (1, 2, 3), (2, 4, 6), (0, 3, 1)]:
            expected = _reference_value(11, sample, c * 35 + h * 7 + w)
            assert noise[n, c, h, w].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_statistics_and_independence():
    like = torch.empty(3, 4, 64, 64)
    noise = randn_like_global(like, seed=0, sample_ids=[0, 1, 2])
    assert noise.dtype == torch.float32 and noise.shape == like.shape
    flat = noise.double().flatten()
    assert abs(flat.mean().item()) < 0.02
    assert abs(flat.std().item() - 1.0) < 0.02
    assert abs((flat.abs() < 1).double().mean().item() - 0.6827) < 0.01  # normal, not just unit variance
    assert abs(((flat**4).mean().item()) - 3.0) < 0.15
    # Samples, channels and neighbouring pixels are uncorrelated.
    pairs = [
        (noise[0], noise[1]),
        (noise[0, 0], noise[0, 1]),
        (noise[..., :-1], noise[..., 1:]),
        (noise[:, :, :-1], noise[:, :, 1:]),
    ]
    for a, b in pairs:
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]).double())[0, 1].item()
        assert abs(corr) < 0.05, corr
    other_seed = randn_like_global(like, seed=1, sample_ids=[0, 1, 2])
    assert not torch.equal(noise, other_seed)


def test_keyed_by_sample_id_not_batch_position():
    like = torch.empty(3, 2, 6, 5)
    full = randn_like_global(like, seed=3, sample_ids=[7, 8, 9])
    torch.testing.assert_close(randn_like_global(like[:1], 3, [8]), full[1:2], rtol=0, atol=0)
    torch.testing.assert_close(randn_like_global(like[:2], 3, torch.tensor([9, 7])), full[[2, 0]], rtol=0, atol=0)
    assert randn_like_global(like.double(), 3, [7, 8, 9]).dtype == torch.float64


def test_volumes():
    like = torch.empty(2, 2, 3, 4, 5)
    noise = randn_like_global(like, 0, [0, 1])
    assert noise.shape == like.shape
    assert noise[0, 1, 2, 3, 4].item() == pytest.approx(_reference_value(0, 0, 60 + 2 * 20 + 3 * 5 + 4), rel=1e-6)


@pytest.mark.parametrize("layout", ["channels_last", "channels_last_3d", "transposed"])
def test_noise_is_laid_out_like_like_with_the_same_values(layout):
    shape = (2, 3, 4, 5, 6) if layout == "channels_last_3d" else (2, 3, 5, 7)
    row_major = randn_like_global(torch.empty(shape), 4, [1, 2])
    if layout == "transposed":
        like = torch.empty(shape).transpose(2, 3).contiguous().transpose(2, 3)
    else:
        like = torch.empty(shape).contiguous(memory_format=getattr(torch, layout))
    noise = randn_like_global(like, 4, [1, 2])
    assert noise.stride() == like.stride()
    torch.testing.assert_close(noise, row_major, rtol=0, atol=0)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="2 sample_ids for a batch of 3"):
        randn_like_global(torch.empty(3, 1, 4, 4), 0, [0, 1])
    with pytest.raises(TypeError, match="floating-point"):
        randn_like_global(torch.empty(1, 1, 4, 4, dtype=torch.int64), 0, [0])
    with pytest.raises(ValueError, match="integer tensor"):
        randn_like_global(torch.empty(1, 1, 4, 4), 0, torch.tensor([0.0]))


def test_sigma_lognormal():
    ids = list(range(4000))
    sigma = sample_sigma_lognormal(5, ids, p_mean=-1.2, p_std=1.2)
    assert sigma.shape == (4000,) and sigma.dtype == torch.float32 and bool((sigma > 0).all())
    log_sigma = sigma.double().log()
    assert abs(log_sigma.mean().item() + 1.2) < 0.06
    assert abs(log_sigma.std().item() - 1.2) < 0.05
    # Per sample, whatever else is in the batch; a different seed changes it.
    torch.testing.assert_close(sample_sigma_lognormal(5, [17, 3], -1.2, 1.2), sigma[[17, 3]], rtol=0, atol=0)
    assert not torch.equal(sample_sigma_lognormal(6, ids, -1.2, 1.2), sigma)
    # Its stream is apart from the field noise of the same seed.
    field = randn_like_global(torch.empty(4000, 1, 1, 1, dtype=torch.float64), 5, ids).flatten()
    assert abs(torch.corrcoef(torch.stack([field, log_sigma]))[0, 1].item()) < 0.06


def test_derive_seed():
    seeds = {derive_seed(0, step) for step in range(100)} | {derive_seed(1, step) for step in range(100)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(3, 1, 2) == derive_seed(3, 1, 2) != derive_seed(3, 2, 1)


# ----- sharded == single device ---------------------------------------------------------------
SHAPE = (2, 3, 13, 7)  # (N, C, H, W): odd extents make the balanced splits uneven


def _check_sharded(mesh_shape, names, placements, sizes, shape, sample_ids, memory_format=torch.contiguous_format):
    mesh = get_mesh(mesh_shape, names)
    like = distribute_tensor(torch.empty(shape).contiguous(memory_format=memory_format), mesh, placements, sizes)
    with count_communication() as log:
        noise = randn_like_global(like, seed=42, sample_ids=sample_ids)
    assert log.calls == 0, log.kinds()
    assert isinstance(noise, ShardTensor) and noise._spec == like._spec
    expected = randn_like_global(torch.empty(shape), seed=42, sample_ids=sample_ids)
    torch.testing.assert_close(noise.full_tensor(), expected, rtol=0, atol=0)
    assert noise.to_local().stride() == like.to_local().stride() or like.to_local().numel() == 0  # an empty slab has any strides
    return noise.to_local()


CASES = {
    "1": ((1,), None, [Shard(2)], None),
    "2-balanced": ((2,), None, [Shard(2)], None),
    "3-uneven": ((3,), None, [Shard(2)], {0: [6, 0, 7]}),
    "4-W": ((4,), None, [Shard(3)], {0: [1, 3, 0, 3]}),
    "4-replicate": ((4,), None, [Replicate()], None),
    "2x2-HxW": ((2, 2), ("h", "w"), [Shard(2), Shard(3)], {0: [9, 4], 1: [2, 5]}),
    "2x2-batch-and-H": ((2, 2), ("data", "domain"), [Shard(0), Shard(2)], {1: [1, 12]}),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_sharded_matches_single_device(case):
    mesh_shape, names, placements, sizes = CASES[case]
    run_on_ranks(math.prod(mesh_shape), _check_sharded, mesh_shape, names, placements, sizes, SHAPE, [5, 2])


@pytest.mark.parametrize("case", ["3-uneven", "2x2-HxW"])
def test_sharded_noise_is_laid_out_like_a_channels_last_like(case):
    """Each rank's slab comes out channels last, under a channels-last spec on every rank (the empty slab's
    too): a diffusion loss then adds it to a channels-last batch without a strided pass."""
    mesh_shape, names, placements, sizes = CASES[case]
    run_on_ranks(math.prod(mesh_shape), _check_sharded, mesh_shape, names, placements, sizes, SHAPE, [5, 2], torch.channels_last)


def test_sharded_volume():
    run_on_ranks(3, _check_sharded, (3,), None, [Shard(3)], {0: [2, 3, 0]}, (2, 2, 3, 5, 4), [0, 1])


def _data_parallel(global_ids):
    """2 data ranks x 2 domain ranks: each data rank holds its own samples, split on H."""
    mesh = get_mesh((2, 2), ("data", "domain"))
    data = mesh.get_local_rank("data")
    ids = global_ids[2 * data : 2 * data + 2]
    domain_mesh = mesh["domain"]
    like = distribute_tensor(torch.empty(2, 3, 13, 7), domain_mesh, [Shard(2)], {0: [8, 5]})
    noise = randn_like_global(like, seed=9, sample_ids=ids)
    expected = randn_like_global(torch.empty(4, 3, 13, 7), seed=9, sample_ids=global_ids)[2 * data : 2 * data + 2]
    torch.testing.assert_close(noise.full_tensor(), expected, rtol=0, atol=0)
    return noise.to_local()


def test_data_parallel_ranks_draw_their_own_samples():
    slabs = run_on_ranks(4, _data_parallel, [10, 11, 12, 13])
    # Ranks are (data, domain) = (0,0), (0,1), (1,0), (1,1): same domain slot, different samples.
    assert slabs[0].shape == slabs[2].shape and not torch.equal(slabs[0], slabs[2])
    assert slabs[0].shape == (2, 3, 8, 7) and slabs[1].shape == (2, 3, 5, 7)
