"""Bilinear interpolation between rectilinear grids by their 1-D coordinates, on hyperslabs.

Each target row (column) takes two source rows (columns) and a weight, computed once from global
coordinates. A rank interpolating rows [r0, r1) reads only the source rows those taps touch, and
every output element is computed by the same arithmetic as in a whole-grid interpolation, so the
two agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinearTaps:
    """For each target point: source indices (lo, hi) and weight w, value = (1 - w) * src[lo] + w * src[hi]."""

    lo: np.ndarray
    hi: np.ndarray
    w: np.ndarray

    def window(self) -> tuple[int, int]:
        """The source index range [start, stop) these taps read."""
        return int(min(self.lo.min(), self.hi.min())), int(max(self.lo.max(), self.hi.max())) + 1

    def sub(self, start: int, stop: int) -> tuple[tuple[int, int], LinearTaps]:
        """Taps of targets [start, stop): the source window they read, and indices relative to it."""
        part = LinearTaps(self.lo[start:stop], self.hi[start:stop], self.w[start:stop])
        window = part.window()
        return window, LinearTaps(part.lo - window[0], part.hi - window[0], part.w)

    def apply(self, a: np.ndarray, axis: int) -> np.ndarray:
        shape = [1] * a.ndim
        shape[axis] = -1
        w = self.w.reshape(shape)
        return (1.0 - w) * np.take(a, self.lo, axis=axis) + w * np.take(a, self.hi, axis=axis)


def linear_taps(source: np.ndarray, target: np.ndarray, name: str) -> LinearTaps:
    """Taps interpolating from strictly monotonic `source` coordinates to `target` coordinates."""
    source = np.asarray(source, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    if source.size < 2:
        raise ValueError(f"background coordinate {name!r} has {source.size} point(s); interpolation needs at least 2")
    step = np.diff(source)
    if not ((step > 0).all() or (step < 0).all()):
        raise ValueError(f"background coordinate {name!r} is not strictly monotonic; sort the background grid")
    low, high = float(source.min()), float(source.max())
    tolerance = 1e-6 * max(1.0, high - low)
    if target.min() < low - tolerance or target.max() > high + tolerance:
        raise ValueError(
            f"the state grid's {name!r} spans [{target.min():g}, {target.max():g}] but the background's spans "
            f"[{low:g}, {high:g}]; the background grid must cover the state grid"
        )
    ascending = step[0] > 0
    ordered = source if ascending else source[::-1]
    n = ordered.size
    lo = np.clip(np.searchsorted(ordered, target, side="right") - 1, 0, n - 2)
    w = np.clip((target - ordered[lo]) / (ordered[lo + 1] - ordered[lo]), 0.0, 1.0)
    hi = lo + 1
    if not ascending:
        lo, hi = n - 1 - lo, n - 1 - hi
    return LinearTaps(lo=lo, hi=hi, w=w)


def interpolate(values: np.ndarray, valid: np.ndarray, rows: LinearTaps, cols: LinearTaps) -> tuple[np.ndarray, np.ndarray]:
    """Interpolate a (h, w) slab; missing source points are left out and the weights renormalized.

    Returns (values, valid); an output is invalid only when every tap with nonzero weight is missing.
    """
    weight = valid.astype(np.float64)
    numerator = cols.apply(rows.apply(np.where(valid, values, 0.0), 0), 1)
    denominator = cols.apply(rows.apply(weight, 0), 1)
    out_valid = denominator > 0
    out = np.divide(numerator, denominator, out=np.zeros_like(numerator), where=out_valid)
    return out, out_valid
