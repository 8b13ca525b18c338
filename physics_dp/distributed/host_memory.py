"""Keep freed host memory in the process instead of handing it back to the kernel after each step.

Why: glibc serves blocks above its mmap threshold (a slab-sized activation is several MiB) with
``mmap`` and frees them with ``munmap``, and trims the heap after large frees.  The next step's
tensor of the same size then faults every page in again.  On the 2-core VM a fault costs about
1.7 us per 4 KiB page: a fresh 8 MiB tensor costs 3.3 ms before its first byte is written, where
the pass that fills it takes 0.3-0.9 ms, so a memory-bound op ran 3-4x slower than its kernel.
A training step frees and allocates the same sizes every step, so keeping the pages, as CUDA's
caching allocator does for device memory, removes the faults.  The price: the process's resident
size stays at the step's peak instead of falling between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["keep_freed_memory"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_MAX = -4
_LARGEST_INT = 2**31 - 1  # mallopt takes a C int


def keep_freed_memory() -> bool:
    """Serve every block from the heap (no ``mmap`` per block) and never trim the heap.

    Returns True when glibc accepted both settings; False where the C library is not glibc
    (musl, macOS, Windows), which leaves allocation as it was.  Affects this process only.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: mallopt's options differ or are absent
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    accepted = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _LARGEST_INT) == 1
    if not accepted:
        log.warning("glibc refused mallopt: freed host memory is returned to the kernel as usual")
    return accepted
