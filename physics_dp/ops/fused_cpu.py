"""Fused CPU kernels for the sharded norms, built from C++ (``csrc/fused_norms.cpp``) on first use.

Why: a sharded norm must have every rank's statistics before it writes an output, and its
backward is ``a * dy + b * x + c`` with coefficients from the global statistics.  torch has
kernels for both on CUDA only (``batch_norm_stats``, ``batch_norm_backward_elemt``); on the CPU
the stock kernels that serve instead cost two more passes over the slab than torch's own fused
norm (the moments kernel also writes normalized rows, which must be rescaled; the backward's
three-operand sum takes two kernels).  Four kernels remove both passes and replace two stock
kernels that are slower on this work (per-row loops that the compiler vectorizes):

- ``row_moments``: each row's mean and 1 / std, reading the rows once and writing nothing;
- ``two_term_affine``: ``a * u + b * v + c`` per row, one pass;
- ``row_affine``: ``a * x + b`` per row (where eval-mode batch norm's kernel served);
- ``grad_sums``: per channel, the sums of dy and dy * (x - mean) (for batch norm's backward
  reduction, 2-3x slower on one thread).

They run on one thread, so they serve only where torch runs one intra-op thread (torchrun's
default for several processes on a host, and what ``docs/performance.md`` recommends); with more
threads torch's parallel stock kernels are used.  The build (a C++ compiler and ninja, through
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

__all__ = ["usable", "row_moments", "two_term_affine", "row_affine", "grad_sums", "set_enabled", "build"]

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
    the CPU, eager, one intra-op thread, and the kernels built (here, on the first call that needs
    them)."""
    if not _enabled or is_tracing() or torch.get_num_threads() != 1:
        return False
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES or first.numel() == 0:
        return False
    if not all(t.is_contiguous() and t.dtype == first.dtype for t in tensors):
        return False
    return _built if _built is not None else build()


def row_moments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1 / std) of each row of a contiguous (P, Q) tensor, float64, biased; 1 / std is inf
    for a constant row (once :func:`usable` said yes).  One read of the rows: blocks summed in
    their dtype about a shift (the row's first value), merged in float64."""
    return torch.ops.physics_dp.row_moments(rows)


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
    flags = ["-O3", "-fopenmp-simd", *_ISA_FLAGS.get(capability, [])]
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
        load(name, [_SOURCE], extra_cflags=flags, build_directory=directory, is_python_module=False, verbose=False)
