"""assert_sharded_matches itself: it must catch what differs, complex parts included, and take ShardTensor inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from physics_dp import Shard, ShardTensor, scatter_tensor
from physics_dp.testing import assert_sharded_matches, get_mesh, run_on_ranks

RANKS = 3
SPLIT = {0: [4, 1, 2]}  # uneven, 7 rows


def _field(complex_values: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.complex64 if complex_values else torch.float32
    return torch.randn(7, 5, generator=gen, dtype=dtype)


def _spectrum(x: torch.Tensor) -> torch.Tensor:
    """A correct complex function of a row-sharded field: FFT over both dims (one sharded)."""
    return torch.fft.fft2(x * 2.0)


def _spectrum_imag_flipped_when_sharded(x: torch.Tensor) -> torch.Tensor:
    """Same real part on both sides; the sharded side's imaginary part has the wrong sign."""
    y = _spectrum(x)
    return torch.conj_physical(y) if isinstance(y, ShardTensor) else y


def _grad_imag_flipped_when_sharded(x: torch.Tensor) -> torch.Tensor:
    """Same output on both sides; the sharded side's gradient is conjugated (imaginary part wrong):
    ``x.conj()`` has gradient ``conj(grad)``, and ``x - x.detach()`` contributes its gradient but no value."""
    z = torch.conj_physical(x) if isinstance(x, ShardTensor) else x
    return x.detach() + (z - z.detach()) * 3.0


def _run(fn_name: str, complex_values: bool) -> dict[str, float] | str:
    mesh = get_mesh((RANKS,))
    try:
        report = assert_sharded_matches(globals()[fn_name], [_field(complex_values)], mesh, [[Shard(0)]], sharding_sizes=[SPLIT])
    except AssertionError as exc:
        return f"AssertionError: {exc}"
    return report.max_abs_diff


def test_complex_function_matches():
    reports = run_on_ranks(RANKS, _run, "_spectrum", True)
    assert all(isinstance(r, dict) and r.keys() == {"output[0]", "input[0].grad"} for r in reports), reports
    assert all(max(r.values()) < 1e-5 for r in reports)


def test_wrong_imaginary_part_of_output_fails():
    reports = run_on_ranks(RANKS, _run, "_spectrum_imag_flipped_when_sharded", True)
    for r in reports:
        assert isinstance(r, str) and r.startswith("AssertionError: output[0]"), r
        worst = float(r.split("up to ")[1].split()[0])
        assert worst > 1.0, r  # the reported difference is the imaginary one, not zero


def test_wrong_imaginary_part_of_gradient_fails():
    reports = run_on_ranks(RANKS, _run, "_grad_imag_flipped_when_sharded", True)
    assert all(isinstance(r, str) and r.startswith("AssertionError: input[0].grad") for r in reports), reports


def test_real_input_is_unaffected_by_conj():
    """On a real field conj is the identity, so the same function passes: the check above failed on
    the imaginary part alone."""
    reports = run_on_ranks(RANKS, _run, "_grad_imag_flipped_when_sharded", False)
    assert all(isinstance(r, dict) and "input[0].grad" in r for r in reports), reports


def _scattered_input() -> list[float]:
    mesh = get_mesh((RANKS,))
    field = _field(complex_values=False)
    x = scatter_tensor(field if dist.get_rank() == 0 else None, 0, mesh, [Shard(0)])
    x = x.redistribute(placements=[Shard(0)], sharding_sizes=SPLIT)
    layer = torch.nn.Linear(5, 3)
    report = assert_sharded_matches(layer, [x], mesh, [None])
    with pytest.raises(ValueError, match="placement None"):
        assert_sharded_matches(layer, [x], mesh, [[Shard(0)]])
    assert report.output_placements == [(Shard(0),)]
    assert set(report.max_abs_diff) == {"output[0]", "input[0].grad", "weight.grad", "bias.grad"}
    return list(report.max_abs_diff.values())


def test_shard_tensor_input_runs_as_given():
    reports = run_on_ranks(RANKS, _scattered_input)
    assert all(max(r) < 1e-5 for r in reports)
