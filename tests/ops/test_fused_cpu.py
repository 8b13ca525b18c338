"""The fused CPU norm kernels against float64 references, when they serve, and how their build fails safely."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from physics_dp.ops import fused_cpu
from physics_dp.testing import get_mesh, run_on_ranks

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None,
    reason="building the kernels needs a C++ compiler and ninja",
)
pytestmark = needs_compiler


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread (one per rank) unless a test says otherwise; the kernels are built first."""
    assert fused_cpu.build()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(x3: torch.Tensor, groups: int, per_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (means, variances) of the statistics of an (N, C, L) slab, each shifted by its
    first value (exact: the values are near it)."""
    x = x3.double()
    n, c, _ = x.shape
    stats = x.reshape(n * groups, -1) if per_sample else x.transpose(0, 1).reshape(c, -1)
    return stats.mean(1), (stats - stats[:, :1]).var(1, correction=0)


def _moments(x3: torch.Tensor, groups: int, per_sample: bool) -> tuple[float, torch.Tensor, torch.Tensor]:
    packed = fused_cpu.norm_moments(x3, groups, per_sample)
    stats = packed.numel() // 2
    assert packed.dtype == torch.float64 and packed.shape == (1 + 2 * stats,)
    return packed[0].item(), packed[1 : 1 + stats], packed[1 + stats :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 7, 16, 2047, 2048, 2049, 5000])
@pytest.mark.parametrize("groups, per_sample", [(2, True), (6, True), (6, False)])
def test_norm_moments_match_float64(dtype: torch.dtype, length: int, groups: int, per_sample: bool) -> None:
    """Per (sample, group) over the group's channels, and per channel over the samples (batch norm)."""
    x3 = torch.randn(3, 6, length, generator=torch.Generator().manual_seed(length), dtype=dtype) * 3 + 2
    assert fused_cpu.usable(x3)
    count, mean, var = _moments(x3, groups, per_sample)
    expected_mean, expected_var = _reference(x3, groups, per_sample)
    assert count == (6 // groups * length if per_sample else 3 * length)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12  # float32: blocks of 2048 summed in float32
    torch.testing.assert_close(mean, expected_mean, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(var, expected_var, atol=0, rtol=4 * tolerance)


def test_norm_moments_far_from_zero_keep_the_variance() -> None:
    """1e4 + N(0, 1) in float32 (a plain sum of squares there loses the variance to cancellation),
    and 1e8 + N(0, 1) in float64."""
    for offset, dtype, tolerance in ((1e4, torch.float32, 1e-5), (1e8, torch.float64, 1e-9)):
        x3 = offset + torch.randn(2, 4, 15000, generator=torch.Generator().manual_seed(1), dtype=dtype)
        for groups, per_sample in ((2, True), (4, False)):
            _, mean, var = _moments(x3, groups, per_sample)
            expected_mean, expected_var = _reference(x3, groups, per_sample)
            torch.testing.assert_close(mean, expected_mean, atol=0, rtol=1e-12)
            torch.testing.assert_close(var, expected_var, atol=0, rtol=2 * tolerance)


def test_norm_moments_of_constant_and_nan_statistics() -> None:
    x3 = torch.randn(3, 1, 100)
    x3[0] = 0.25
    x3[1, 0, 17] = float("nan")
    _, mean, var = _moments(x3, 1, True)
    assert mean[0] == 0.25 and var[0] == 0
    assert mean[1].isnan() and var[1].isnan()
    assert var[2].isfinite()


def _packed(counts: list[float], means: torch.Tensor, variances: torch.Tensor) -> torch.Tensor:
    return torch.cat((torch.tensor(counts, dtype=torch.float64)[:, None], means, variances), 1).contiguous()


def test_merge_moments_is_the_moments_of_the_union() -> None:
    """Three ranks' statistics of unequal parts (one empty) merge into those of the whole."""
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randn(4, size, generator=generator, dtype=torch.float64) * 2 + 5 for size in (30, 0, 70)]
    gathered = _packed(
        [float(p.shape[1]) for p in parts],
        torch.stack([p.mean(1) if p.shape[1] else torch.zeros(4, dtype=torch.float64) for p in parts]),
        torch.stack([p.var(1, correction=0) if p.shape[1] else torch.zeros(4, dtype=torch.float64) for p in parts]),
    )
    merged = fused_cpu.merge_moments(gathered)
    whole = torch.cat(parts, 1)
    assert merged[0] == 100
    torch.testing.assert_close(merged[1:5], whole.mean(1), atol=1e-13, rtol=0)
    torch.testing.assert_close(merged[5:], whole.var(1, correction=0), atol=1e-12, rtol=0)
    nothing = fused_cpu.merge_moments(torch.zeros(2, 9, dtype=torch.float64))  # every part empty
    assert torch.equal(nothing, torch.zeros(9, dtype=torch.float64))


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("groups, per_sample", [(2, True), (6, False)])
def test_norm_coefficients_normalize_and_differentiate(affine: bool, groups: int, per_sample: bool) -> None:
    """y = scale * x + shift is the group (batch) norm, and dx = scale * dy + beta * x + gamma and the
    parameter gradients are its gradients (against torch's own norm, in float64)."""
    generator = torch.Generator().manual_seed(groups)
    x3 = torch.randn(3, 6, 50, generator=generator, dtype=torch.float64) + 3
    dy = torch.randn(3, 6, 50, generator=generator, dtype=torch.float64)
    weight, bias = (torch.randn(6, generator=generator, dtype=torch.float64).requires_grad_(True) for _ in range(2))
    packed = fused_cpu.norm_moments(x3, groups, per_sample)
    w, b = (weight, bias) if affine else (None, None)
    coefficients, rstd = fused_cpu.norm_coefficients(packed, w, b, 1e-5, (3, 6), groups, per_sample, torch.float64)
    y = fused_cpu.row_affine(x3.view(18, 50), coefficients[0], coefficients[1]).view(3, 6, 50)
    reference_x = x3.clone().requires_grad_(True)
    if per_sample:
        expected = F.group_norm(reference_x, groups, w, b, 1e-5)
    else:
        expected = F.batch_norm(reference_x, None, None, w, b, training=True, eps=1e-5)
    torch.testing.assert_close(y, expected, atol=1e-12, rtol=0)
    expected.backward(dy)
    mean_rows = coefficients[2] if per_sample else coefficients[2, :6]
    grid = (1, 18, 50) if per_sample else (3, 6, 50)
    sums = fused_cpu.grad_sums(dy.view(grid), x3.view(grid), mean_rows)
    terms, param_grads = fused_cpu.norm_grad_coefficients(sums, packed, rstd, w, 3, groups, per_sample, torch.float64)
    dx = fused_cpu.two_term_affine(dy.view(18, 50), x3.view(18, 50), coefficients[0], terms[0], terms[1]).view(3, 6, 50)
    torch.testing.assert_close(dx, reference_x.grad, atol=1e-12, rtol=0)
    if affine:
        torch.testing.assert_close(param_grads[0], weight.grad, atol=1e-12, rtol=0)
        torch.testing.assert_close(param_grads[1], bias.grad, atol=1e-12, rtol=0)


def test_norm_coefficients_refuse_mismatched_statistics() -> None:
    packed = fused_cpu.norm_moments(torch.randn(2, 4, 10), 2, True)
    with pytest.raises(RuntimeError, match="packed statistics"):
        fused_cpu.norm_coefficients(packed, None, None, 1e-5, (3, 4), 2, True, torch.float32)
    with pytest.raises(RuntimeError, match="per-channel parameter"):
        fused_cpu.norm_coefficients(packed, torch.ones(3), None, 1e-5, (2, 4), 2, True, torch.float32)
    with pytest.raises(RuntimeError, match="groups must divide"):
        fused_cpu.norm_moments(torch.randn(2, 4, 10), 3, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_term_affine(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    u, v = (torch.randn(5, 3001, generator=generator, dtype=dtype) for _ in range(2))
    a, b, c = (torch.randn(5, generator=generator, dtype=dtype) for _ in range(3))
    out = fused_cpu.two_term_affine(u, v, a, b, c)
    expected = a.double()[:, None] * u.double() + b.double()[:, None] * v.double() + c.double()[:, None]
    torch.testing.assert_close(out.double(), expected, atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=0)
    with pytest.raises(RuntimeError, match="coefficients"):
        fused_cpu.two_term_affine(u, v, a[:4], b, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_affine(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2049, generator=generator, dtype=dtype)
    a, b = (torch.randn(6, generator=generator, dtype=dtype) for _ in range(2))
    expected = a.double()[:, None] * x.double() + b.double()[:, None]
    torch.testing.assert_close(fused_cpu.row_affine(x, a, b).double(), expected, atol=1e-6 if dtype == torch.float32 else 1e-13, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("samples", [1, 3])
def test_grad_sums_over_samples_and_length(dtype: torch.dtype, samples: int) -> None:
    generator = torch.Generator().manual_seed(samples)
    g, x = (torch.randn(samples, 5, 4099, generator=generator, dtype=dtype) for _ in range(2))
    x = x + 100  # the centering happens inside, about the given mean
    mean = x.mean((0, 2))
    sums = fused_cpu.grad_sums(g, x, mean)
    gd, centered = g.double(), x.double() - mean.double()[None, :, None]
    expected = torch.stack((gd.sum((0, 2)), (gd * centered).sum((0, 2))))
    assert sums.dtype == torch.float64 and sums.shape == (2, 5)
    torch.testing.assert_close(sums, expected, atol=1e-3 if dtype == torch.float32 else 1e-9, rtol=1e-5 if dtype == torch.float32 else 1e-12)
    with pytest.raises(RuntimeError, match="mean"):
        fused_cpu.grad_sums(g, x, mean[:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [True, False])
def test_row_affine_elementwise(dtype: torch.dtype, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2049, generator=generator, dtype=dtype)
    a, c = (torch.randn(4, generator=generator, dtype=dtype) for _ in range(2))
    w, b = (torch.randn(2049, generator=generator, dtype=dtype) for _ in range(2))
    expected = (a.double()[:, None] * x.double() + c.double()[:, None]) * w.double() + (b.double() if with_bias else 0)
    out = fused_cpu.row_affine_elementwise(x, a, c, w, b if with_bias else None)
    torch.testing.assert_close(out.double(), expected, atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=0)
    with pytest.raises(RuntimeError, match="w must be"):
        fused_cpu.row_affine_elementwise(x, a, c, w[:7], None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_term_affine_elementwise(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    u, v = (torch.randn(5, 3001, generator=generator, dtype=dtype) for _ in range(2))
    w = torch.randn(3001, generator=generator, dtype=dtype)
    a, b, c = (torch.randn(5, generator=generator, dtype=dtype) for _ in range(3))
    out = fused_cpu.two_term_affine_elementwise(u, v, w, a, b, c)
    ud, vd = u.double(), v.double()
    expected = a.double()[:, None] * ud * w.double() + b.double()[:, None] * vd + c.double()[:, None]
    torch.testing.assert_close(out.double(), expected, atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("param_grads", [True, False])
def test_weighted_grad_sums_and_the_affine_gradients_in_one_pass(dtype: torch.dtype, param_grads: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    dy, x = (torch.randn(3, 4099, generator=generator, dtype=dtype) for _ in range(2))
    x = x + 100  # the centering happens inside, about the given mean
    w = torch.randn(4099, generator=generator, dtype=dtype)
    mean, rstd = x.mean(1), torch.rand(3, generator=generator, dtype=dtype) + 0.5
    sums, grads = fused_cpu.weighted_grad_sums(dy, x, w, mean, rstd, param_grads)
    g, centered = dy.double() * w.double(), x.double() - mean.double()[:, None]
    expected = torch.stack((g.sum(1), (g * centered).sum(1)))
    assert sums.dtype == torch.float64 and sums.shape == (2, 3)
    torch.testing.assert_close(sums, expected, atol=1e-3 if dtype == torch.float32 else 1e-9, rtol=1e-5 if dtype == torch.float32 else 1e-12)
    if not param_grads:
        assert grads.numel() == 0
        return
    expected_grads = torch.stack(((dy.double() * centered * rstd.double()[:, None]).sum(0), dy.double().sum(0)))
    assert grads.dtype == dtype and grads.shape == (2, 4099)
    torch.testing.assert_close(grads.double(), expected_grads, atol=1e-4 if dtype == torch.float32 else 1e-11, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 7, 2048, 5000])
@pytest.mark.parametrize("groups, per_sample", [(2, True), (6, True), (6, False)])
def test_channels_last_moments_match_float64(dtype: torch.dtype, length: int, groups: int, per_sample: bool) -> None:
    """The statistics of the (N, L, C) view of a channels-last slab: those of its (N, C, L) rows,
    also far from zero (each channel summed about its own first value)."""
    x3 = torch.randn(3, 6, length, generator=torch.Generator().manual_seed(length), dtype=dtype) * 3 + 1e3
    tokens = x3.transpose(1, 2).contiguous()
    packed = fused_cpu.channels_last_moments(tokens, groups, per_sample)
    stats = packed.numel() // 2
    expected_mean, expected_var = _reference(x3, groups, per_sample)
    assert packed[0].item() == (6 // groups * length if per_sample else 3 * length)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(packed[1 : 1 + stats], expected_mean, atol=0, rtol=tolerance)
    torch.testing.assert_close(packed[1 + stats :], expected_var, atol=0, rtol=40 * tolerance)
    with pytest.raises(RuntimeError, match="groups"):
        fused_cpu.channels_last_moments(tokens, 4, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_channels_last_affines(dtype: torch.dtype) -> None:
    """a * x + c and a * u + b * v + c with one coefficient per (sample, channel), channels innermost."""
    generator = torch.Generator().manual_seed(0)
    u, v = (torch.randn(2, 301, 5, generator=generator, dtype=dtype) for _ in range(2))
    a, b, c = (torch.randn(2 * 5, generator=generator, dtype=dtype) for _ in range(3))
    per = [k.double().view(2, 1, 5) for k in (a, b, c)]
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(fused_cpu.channels_last_affine(u, a, c).double(), per[0] * u.double() + per[2], atol=tolerance, rtol=0)
    expected = per[0] * u.double() + per[1] * v.double() + per[2]
    torch.testing.assert_close(fused_cpu.channels_last_two_term_affine(u, v, a, b, c).double(), expected, atol=tolerance, rtol=0)
    with pytest.raises(RuntimeError, match="coefficients"):
        fused_cpu.channels_last_affine(u, a[:5], c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_sample", [True, False])
def test_channels_last_grad_sums(dtype: torch.dtype, per_sample: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    g, x = (torch.randn(3, 4099, 5, generator=generator, dtype=dtype) for _ in range(2))
    x = x + 100
    mean = (x.mean(1) if per_sample else x.mean((0, 1))).reshape(-1).contiguous()
    sums = fused_cpu.channels_last_grad_sums(g, x, mean, per_sample)
    gd, centered = g.double(), x.double() - mean.double().view(3 if per_sample else 1, 1, 5)
    expected = torch.stack((gd.sum(1), (gd * centered).sum(1)))
    expected = expected.reshape(2, -1) if per_sample else expected.sum(1)
    assert sums.dtype == torch.float64 and sums.shape == (2, 15 if per_sample else 5)
    torch.testing.assert_close(sums, expected, atol=1e-3 if dtype == torch.float32 else 1e-9, rtol=1e-5 if dtype == torch.float32 else 1e-12)
    with pytest.raises(RuntimeError, match="mean"):
        fused_cpu.channels_last_grad_sums(g, x, mean[:4], per_sample)


def test_usable_only_where_the_kernels_apply() -> None:
    x = torch.randn(4, 6)
    assert fused_cpu.usable(x, x)
    assert not fused_cpu.usable(x.t())  # not contiguous
    assert not fused_cpu.usable(x.bfloat16())
    assert not fused_cpu.usable(torch.randn(0, 6))
    assert not fused_cpu.usable(x, x.double())
    torch.set_num_threads(2)  # (the fixture restores one thread)
    assert fused_cpu.usable(x)  # every pass splits its work over the threads
    previous = fused_cpu.set_enabled(False)
    try:
        assert not fused_cpu.usable(x)
    finally:
        fused_cpu.set_enabled(previous)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def _norm_ops(enabled: bool) -> set[str]:
    from physics_dp.shard_tensor import Shard, distribute_tensor

    previous = fused_cpu.set_enabled(enabled)
    try:
        x = distribute_tensor(torch.randn(1, 8, 12, 6), get_mesh((2,)), [Shard(2)]).requires_grad_(True)
        with _Ops() as ops:
            F.group_norm(x, 2).square().sum().backward()
        return ops.names
    finally:
        fused_cpu.set_enabled(previous)


def _layer_norm_ops(enabled: bool, input_grad: bool = True) -> tuple[set[str], float]:
    """The ops a sharded layer norm with affine parameters runs, and its weight gradient's largest
    difference from one device's."""
    from physics_dp.shard_tensor import Shard, distribute_tensor

    previous = fused_cpu.set_enabled(enabled)
    try:
        full = torch.randn(2, 4, 12, 6, generator=torch.Generator().manual_seed(0))
        x = distribute_tensor(full, get_mesh((2,)), [Shard(2)]).requires_grad_(input_grad)
        weight, bias = torch.randn(4, 12, 6, requires_grad=True), torch.randn(4, 12, 6, requires_grad=True)
        with _Ops() as ops:
            F.layer_norm(x, (4, 12, 6), weight, bias).square().sum().backward()
        reference = weight.detach().clone().requires_grad_(True)
        F.layer_norm(full, (4, 12, 6), reference, bias.detach()).square().sum().backward()
        return ops.names, (weight.grad - reference.grad).abs().max().item()
    finally:
        fused_cpu.set_enabled(previous)


def test_a_sharded_layer_norm_applies_its_affine_in_the_kernels_passes() -> None:
    fused, error = run_on_ranks(2, _layer_norm_ops, True)[0]
    kernels = ("norm_moments", "row_affine_elementwise", "weighted_grad_sums", "two_term_affine_elementwise")
    assert {f"physics_dp::{kernel}" for kernel in kernels} <= fused and error < 1e-4
    assert "aten::addcmul" not in fused  # no separate affine pass
    stock, error = run_on_ranks(2, _layer_norm_ops, False)[0]
    assert "aten::addcmul" in stock and error < 1e-4
    # only the gradients asked for: an input that needs none gets no dx pass
    params_only, error = run_on_ranks(2, _layer_norm_ops, True, False)[0]
    assert "physics_dp::weighted_grad_sums" in params_only and error < 1e-4
    assert "physics_dp::two_term_affine_elementwise" not in params_only


def test_a_sharded_group_norm_takes_the_kernels_on_ranks() -> None:
    fused = run_on_ranks(2, _norm_ops, True)[0]
    kernels = ("norm_moments", "merge_moments", "norm_coefficients", "row_affine", "grad_sums", "norm_grad_coefficients", "two_term_affine")
    assert {f"physics_dp::{kernel}" for kernel in kernels} <= fused
    assert "aten::native_batch_norm_backward" not in fused
    assert "aten::native_group_norm" not in fused
    stock = run_on_ranks(2, _norm_ops, False)[0]
    assert not any(name.startswith("physics_dp::") for name in stock) and "aten::native_group_norm" in stock


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_a_failed_build_warns_once_and_leaves_the_stock_kernels(tmp_path) -> None:
    result = _python(
        """
        import warnings, torch
        torch.set_num_threads(1)
        from physics_dp.ops import fused_cpu
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(fused_cpu.usable(torch.ones(2, 2)), fused_cpu.usable(torch.ones(2, 2)))
        print(len(caught), caught[0].message if caught else "")
        """,
        {"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-compiler")},
    )
    assert result.returncode == 0, result.stderr
    usable, warning = result.stdout.splitlines()
    assert usable == "False False"
    assert warning.startswith("1 physics_dp could not build its fused CPU norm kernels") and "stock kernels" in warning


def test_a_build_lock_left_by_a_dead_build_does_not_hang() -> None:
    """torch's own build lock, left behind by a build that was killed, would make it wait forever."""
    assert fused_cpu.build()
    code = """
        import glob, os, torch
        from physics_dp.ops import fused_cpu
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
        directory = sorted(glob.glob(os.path.join(root, "physics_dp_fused_norms_*")), key=os.path.getmtime)[-1]
        open(os.path.join(directory, "lock"), "w").close()
        print(fused_cpu.build(), os.path.exists(os.path.join(directory, "lock")))
        """
    result = _python(code, {})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_ranks_building_at_once_share_one_build(tmp_path) -> None:
    """Several processes that first need the kernels at the same moment (the ranks of a new job):
    one builds under the lock, the others wait for it and load its library."""
    code = """
        import time, torch
        from physics_dp.ops import fused_cpu
        start = time.perf_counter()
        print(fused_cpu.build(), round(time.perf_counter() - start, 1))
        """
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    processes = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0 and out.split()[0] == "True", err
    libraries = list(tmp_path.glob("physics_dp_fused_norms_*/*.so"))
    assert len(libraries) == 1, libraries


def _every_pass(threads: int) -> list[torch.Tensor]:
    """Every pass on inputs large enough to split over threads (see ``kParallelWork``), the
    channels-last ones on a (samples, length, channels) slab of several blocks of rows."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    x3, g3 = (torch.randn(3, 8, 40000, generator=generator) * 3 + 2 for _ in range(2))
    rows, grads = x3.view(24, -1), g3.view(24, -1)
    a, b, c = (torch.randn(24, generator=generator) for _ in range(3))
    mean = torch.randn(8, generator=generator)
    weight, bias = (torch.randn(40000 * 8, generator=generator) for _ in range(2))
    layer_x, layer_dy = x3.view(3, -1), g3.view(3, -1)
    layer_mean, layer_rstd = layer_x.mean(1), layer_x.var(1).rsqrt()
    tokens, token_grads = x3.view(3, 40000, 8), g3.view(3, 40000, 8)  # channels innermost
    ca, cb, cc = (torch.randn(24, generator=generator) for _ in range(3))  # per (sample, channel)
    return [
        fused_cpu.norm_moments(x3, 4, True), fused_cpu.norm_moments(x3, 8, False),
        fused_cpu.row_affine(rows, a, c), fused_cpu.two_term_affine(grads, rows, a, b, c),
        fused_cpu.grad_sums(g3, x3, mean), fused_cpu.grad_sums(grads.view(1, 24, -1), rows.view(1, 24, -1), a),
        fused_cpu.row_affine_elementwise(layer_x, layer_mean, layer_rstd, weight, bias),
        fused_cpu.two_term_affine_elementwise(layer_dy, layer_x, weight, layer_mean, layer_rstd, layer_mean),
        *fused_cpu.weighted_grad_sums(layer_dy, layer_x, weight, layer_mean, layer_rstd, True),
        fused_cpu.weighted_grad_sums(layer_dy, layer_x, weight, layer_mean, layer_rstd, False)[0],
        fused_cpu.channels_last_moments(tokens, 4, True), fused_cpu.channels_last_moments(tokens, 8, False),
        fused_cpu.channels_last_affine(tokens, ca, cc), fused_cpu.channels_last_two_term_affine(token_grads, tokens, ca, cb, cc),
        fused_cpu.channels_last_grad_sums(token_grads, tokens, ca, True),
        fused_cpu.channels_last_grad_sums(token_grads, tokens, mean, False),
    ]


def test_every_pass_gives_the_same_result_on_any_number_of_threads() -> None:
    """Each statistic, row or channel is computed whole by one thread, or each block of rows or
    values summed by one and the blocks added in block order: the same bits on 1, 2 and 3 threads
    (the row-major statistics ran 1.6x faster on two threads than on one here)."""
    one = _every_pass(1)
    for threads in (2, 3):
        for index, (got, expected) in enumerate(zip(_every_pass(threads), one)):
            assert torch.equal(got, expected), (threads, index)


def _sharded_norms_on_threads(threads: int, rows: list[int]) -> list[str]:
    from physics_dp.testing.compare import assert_sharded_matches
    from physics_dp.shard_tensor import Shard

    torch.set_num_threads(threads)
    try:
        mesh, x = get_mesh((len(rows),)), torch.randn(2, 8, sum(rows), 6, generator=torch.Generator().manual_seed(1))
        checked = []
        for name, module, layout in (
            ("group", torch.nn.GroupNorm(4, 8), torch.contiguous_format),
            ("batch", torch.nn.BatchNorm2d(8), torch.contiguous_format),
            ("layer", torch.nn.LayerNorm([8, sum(rows), 6]), torch.contiguous_format),
            ("channels-last group", torch.nn.GroupNorm(4, 8), torch.channels_last),
            ("channels-last batch", torch.nn.BatchNorm2d(8), torch.channels_last),
        ):
            with _Ops() as ops:
                assert_sharded_matches(
                    module, [x.contiguous(memory_format=layout)], mesh, [[Shard(2)]], sharding_sizes=[{0: rows}],
                    atol=1e-5, rtol=1e-5,
                )
            fused = any(op.startswith("physics_dp::") for op in ops.names) and "aten::addcmul" not in ops.names
            checked.append(f"{name}: {'fused' if fused else 'stock'}")
        return checked
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("rows", [[8, 5], [6, 4, 3]])
def test_sharded_norms_on_ranks_with_two_threads_take_the_kernels_and_match_one_device(rows: list[int]) -> None:
    """Group and batch norm in both layouts and layer norm with its elementwise affine (applied in
    the kernels' passes, no separate ``addcmul``) on 2 and 3 ranks of two threads, uneven splits.
    Channels last and layer norm's affine used to take torch's stock kernels there (their sums ran
    on one thread)."""
    for checked in run_on_ranks(len(rows), _sharded_norms_on_threads, 2, rows):
        assert checked == [
            "group: fused", "batch: fused", "layer: fused", "channels-last group: fused", "channels-last batch: fused",
        ], checked
