"""Seeds every rank derives alike without communicating: splitmix64 over integer keys.

Sharded random numbers need streams that depend only on a seed and integer keys (a sample
index, a step, a rank's coordinates), never on how much a generator drew before.  splitmix64's
output function (Steele, Lea & Flood 2014) mixes nearby keys into unrelated 64-bit values.
"""

from __future__ import annotations

__all__ = ["GAMMA", "MASK64", "MUL1", "MUL2", "derive_seed", "mix64"]

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment (odd, golden-ratio based)
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """splitmix64's output function on Python ints (exact 64-bit arithmetic)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MUL1) & MASK64
    z = ((z ^ (z >> 27)) * MUL2) & MASK64
    return z ^ (z >> 31)


def derive_seed(seed: int, *keys: int) -> int:
    """A new 63-bit seed from ``seed`` and integer keys (e.g. a step index), for independent streams."""
    h = mix64(int(seed) + GAMMA)
    for key in keys:
        h = mix64((h ^ (int(key) & MASK64)) + GAMMA)
    return h >> 1
