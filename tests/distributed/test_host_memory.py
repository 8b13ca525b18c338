"""keep_freed_memory: a freed large tensor's pages stay in the process (no munmap, no refault)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import os, sys, torch
from physics_dp.distributed.host_memory import keep_freed_memory

def resident_mib():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

kept = keep_freed_memory() if sys.argv[1] == "keep" else None
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written: resident
before_free = resident_mib()
del block
print(kept, before_free - resident_mib())
"""


def _freed_mib(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_memory_stays_resident_only_when_kept():
    _, returned_by_default = _freed_mib("default")
    kept, returned_when_kept = _freed_mib("keep")
    assert returned_by_default > 60  # glibc unmaps a 64 MiB block on free
    assert kept == "True" and returned_when_kept < 1
