"""Fused CPU kernels for the sharded norms, built from C++ (``csrc/fused_norms.cpp``) on first use.

Why: a sharded norm must have every rank's statistics before it writes an output, and its
backward is ``a * dy + b * x + c`` with coefficients from the global statistics.  torch has
kernels for both on CUDA only (``batch_norm_stats``, ``batch_norm_backward_elemt``); on the CPU
the stock kernels that serve instead cost two more passes over the slab than torch's own fused
norm (the moments kernel also writes normalized rows, which must be rescaled; the backward's
three-operand sum takes two kernels).  Four kernels remove both passes and replace two stock
kernels that are slower on this work (per-row loops that the compiler vectorizes):

- ``norm_moments``: the statistics of the slab, reading it once and writing nothing;
- ``two_term_affine``: ``a * u + b * v + c`` per row, one pass;
- ``row_affine``: ``a * x + b`` per row (where eval-mode batch norm's kernel served);
- ``grad_sums``: per channel, the sums of dy and dy * (x - mean) (for batch norm's backward
  reduction, 2-3x slower on one thread).

Three more carry layer norm's elementwise affine parameters through the same passes, where torch's
fused ``layer_norm`` applies them in its own: ``row_affine_elementwise`` (the output),
``weighted_grad_sums`` (the backward's sums through the weight, and the parameters' gradients in
the same pass) and ``two_term_affine_elementwise`` (dx).

Four more take a channels-last slab, viewed as (samples, length, channels) with the channels
innermost, where the others take (samples, channels, length) rows: ``channels_last_moments``,
``channels_last_affine``, ``channels_last_two_term_affine`` and ``channels_last_grad_sums`` (a
channels-last model's norms then read and write its own layout; copied row-major, every norm took two
more passes, and the convolutions after it reordered their input back).

Three more do the arithmetic on the few statistics in between, each in one call where it took
about twenty small tensor ops per norm (a fixed host cost per call, 0.2-0.5 ms with the caches cold
after the slab's passes): ``merge_moments`` (Chan's merge of the ranks' statistics),
``norm_coefficients`` (the forward's scale and shift per channel) and ``norm_grad_coefficients``
(the backward's, and the affine parameters' gradients).

Every pass splits its work over torch's intra-op threads (``at::parallel_for``, built with
OpenMP) so that a result does not depend on the thread count: each statistic, row or channel is
computed whole by one thread, or, where a sum runs across the rows (the channels-last passes, layer
norm's weighted sums), each block of rows or values is summed by one thread and the blocks' sums
add up in block order.  The build (a C++ compiler and ninja, through
``torch.utils.cpp_extension``) happens once per machine and source, into the torch extensions
directory (``TORCH_EXTENSIONS_DIR``), under a lock the operating system releases if the builder
dies.  If it fails, the norms keep torch's stock kernels and one warning says why.
``PHYSICS_DP_FUSED_CPU_KERNELS=0`` turns the kernels off without building them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import warnings

import torch

from ..distributed.tracing import is_tracing

__all__ = [
    "usable", "norm_moments", "merge_moments", "norm_coefficients", "norm_grad_coefficients", "two_term_affine", "row_affine",
    "grad_sums", "row_affine_elementwise", "two_term_affine_elementwise", "weighted_grad_sums", "channels_last_moments",
    "channels_last_affine", "channels_last_two_term_affine", "channels_last_grad_sums", "set_enabled", "build",
]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "fused_norms.cpp")
_DTYPES = (torch.float32, torch.float64)
_ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx2", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}
_logger = logging.getLogger(__name__)

_enabled = os.environ.get("PHYSICS_DP_FUSED_CPU_KERNELS", "1") != "0"
_built: bool | None = None  # None: not tried yet


def set_enabled(enabled: bool) -> bool:
    """Turn the kernels on or off in this process (e.g. to compare with the stock path); returns
    the previous setting."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: contiguous, of one dtype (float32 or float64), on
    the CPU, eager, and the kernels built (here, on the first call that needs them)."""
    if not _enabled or is_tracing():
        return False
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES or first.numel() == 0:
        return False
    if not all(t.is_contiguous() and t.dtype == first.dtype for t in tensors):
        return False
    return _built if _built is not None else build()


def norm_moments(x3: torch.Tensor, groups: int, per_sample: bool) -> torch.Tensor:
    """The statistics of a contiguous (N, C, L) slab packed as ``[count, means, variances]``
    (float64, biased; S = N * groups statistics per (sample, group), or C per channel over the
    samples where not ``per_sample``), reading the slab once (once :func:`usable` said yes).
    Blocks are summed in the slab's dtype about a shift (each statistic's first value), merged in
    float64."""
    return torch.ops.physics_dp.norm_moments(x3, groups, per_sample)


def merge_moments(gathered: torch.Tensor) -> torch.Tensor:
    """Chan's merge of the packed statistics of several ranks, the rows of a (ranks, 1 + 2 S)
    float64 tensor, into one packed row (an empty part weighs nothing)."""
    return torch.ops.physics_dp.merge_moments(gathered)


def norm_coefficients(
    packed: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    shape: tuple[int, int], groups: int, per_sample: bool, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From merged packed statistics: rows (scale, shift, mean) per (sample, channel) of an
    (N, C) = ``shape`` slab, in ``dtype`` (y = scale * x + shift), and 1 / std per statistic
    (float64)."""
    samples, channels = shape
    return torch.ops.physics_dp.norm_coefficients(packed, weight, bias, eps, samples, channels, groups, per_sample, dtype)


def norm_grad_coefficients(
    sums: torch.Tensor, packed: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
    samples: int, groups: int, per_sample: bool, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the all-reduced sums of dy and dy * (x - mean) per (sample, channel) (per channel for
    statistics over the samples), stacked (2, .), float64: rows (beta, gamma) per (sample, channel)
    in ``dtype`` (dx = scale * dy + beta * x + gamma), and the weight and bias gradients stacked
    (2, C), float64."""
    return torch.ops.physics_dp.norm_grad_coefficients(sums, packed, rstd, weight, samples, groups, per_sample, dtype)


def two_term_affine(u: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * u + b * v + c`` for contiguous (P, Q) ``u`` and ``v`` and (P,) coefficients, all of one
    dtype (once :func:`usable` said yes)."""
    return torch.ops.physics_dp.two_term_affine(u, v, a, b, c)


def row_affine(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * x + b`` for a contiguous (P, Q) ``x`` and (P,) coefficients of its dtype (once
    :func:`usable` said yes)."""
    return torch.ops.physics_dp.row_affine(x, a, b)


def grad_sums(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Per channel of contiguous (N, C, L) ``g`` and ``x``: the sums over N and L of g and of
    g * (x - mean), stacked (2, C), float64; ``mean`` is (C,) of x's dtype (once :func:`usable`
    said yes)."""
    return torch.ops.physics_dp.grad_sums(g, x, mean)


def row_affine_elementwise(
    x: torch.Tensor, a: torch.Tensor, c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    """``(a * x + c) * w + b`` for a contiguous (P, Q) ``x``, (P,) ``a`` and ``c`` and (Q,) ``w`` and
    ``b`` (or no ``b``), all of one dtype (once :func:`usable` said yes)."""
    return torch.ops.physics_dp.row_affine_elementwise(x, a, c, w, b)


def two_term_affine_elementwise(
    u: torch.Tensor, v: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """``a * u * w + b * v + c`` for contiguous (P, Q) ``u`` and ``v``, (Q,) ``w`` and (P,) coefficients,
    all of one dtype (once :func:`usable` said yes)."""
    return torch.ops.physics_dp.two_term_affine_elementwise(u, v, w, a, b, c)


def weighted_grad_sums(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, param_grads: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of contiguous (P, Q) ``dy`` and ``x``, with g = dy * w ((Q,) ``w``): the sums of g and
    of g * (x - mean), stacked (2, P), float64; and where ``param_grads``, summed over the rows,
    dy * (x - mean) * rstd and dy, stacked (2, Q) in x's dtype (else empty), in the same pass.
    ``mean`` and ``rstd`` are (P,) of x's dtype (once :func:`usable` said yes)."""
    return torch.ops.physics_dp.weighted_grad_sums(dy, x, w, mean, rstd, param_grads)


def channels_last_moments(x: torch.Tensor, groups: int, per_sample: bool) -> torch.Tensor:
    """:func:`norm_moments` of a channels-last slab, the contiguous (N, L, C) view of it (once
    :func:`usable` said yes)."""
    return torch.ops.physics_dp.channels_last_moments(x, groups, per_sample)


def channels_last_affine(x: torch.Tensor, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * x + c`` for a contiguous (N, L, C) ``x`` and (N * C,) coefficients of its dtype, one per
    (sample, channel) (once :func:`usable` said yes)."""
    return torch.ops.physics_dp.channels_last_affine(x, a, c)


def channels_last_two_term_affine(
    u: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """``a * u + b * v + c`` for contiguous (N, L, C) ``u`` and ``v`` and (N * C,) coefficients, all
    of one dtype (once :func:`usable` said yes)."""
    return torch.ops.physics_dp.channels_last_two_term_affine(u, v, a, b, c)


def channels_last_grad_sums(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, per_sample: bool) -> torch.Tensor:
    """The sums over L of g and of g * (x - mean) for contiguous (N, L, C) ``g`` and ``x``, per
    (sample, channel) with an (N * C,) ``mean``, or per channel over the samples too with a (C,)
    one; stacked (2, statistics), float64 (once :func:`usable` said yes)."""
    return torch.ops.physics_dp.channels_last_grad_sums(g, x, mean, per_sample)


def build() -> bool:
    """Build or load the kernels into torch's op registry (``torch.ops.physics_dp``) now, as the first
    call that needs them otherwise does (e.g. before starting rank processes that would wait for the
    build); False where that failed (with a warning).  Done once per process."""
    global _built
    if _built is not None:
        return _built
    _built = False
    try:
        _build()
        _built = True
    except Exception as error:  # no compiler, no ninja, a read-only cache: the stock kernels serve
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        warnings.warn(
            f"physics_dp could not build its fused CPU norm kernels ({type(error).__name__}: {first_line}); "
            "the sharded norms use torch's stock kernels, which take two more passes over each slab. "
            "Set PHYSICS_DP_FUSED_CPU_KERNELS=0 to skip the build.",
            RuntimeWarning,
            stacklevel=4,
        )
    return _built


def _build() -> None:
    """Build (once per machine and source) or load the extension, under an exclusive file lock."""
    import fcntl

    from torch.utils.cpp_extension import load

    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *_ISA_FLAGS.get(capability, [])]  # OpenMP: at::parallel_for on torch's threads
    with open(_SOURCE, "rb") as source:
        key = hashlib.sha1(source.read())
    key.update(f"{torch.__version__} {sys.version_info[:2]} {capability} {flags}".encode())
    name = f"physics_dp_fused_norms_{key.hexdigest()[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    directory = os.path.join(root, name)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "physics_dp.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if this process dies mid-build
        baton = os.path.join(directory, "lock")
        if os.path.exists(baton):  # torch's own build lock, left only by a build that died: it would wait forever
            os.remove(baton)
        if not os.path.exists(os.path.join(directory, f"{name}.so")):
            _logger.info("building physics_dp's fused CPU norm kernels into %s (once per machine)", directory)
        load(
            name, [_SOURCE], extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=directory,
            is_python_module=False, verbose=False,
        )
