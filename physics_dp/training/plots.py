"""Diagnostic figures for training and inference: prediction panels and isotropic power spectra.

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas, never through pyplot, so
plotting holds no global figure state, needs no display, and leaks nothing across calls in a
long training run.

Inputs are plain arrays or tensors. A ShardTensor is refused: gathering it is a collective every
rank must join, so the caller gathers (``.full_tensor()`` on all ranks) and plots on one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from physics_dp.shard_tensor import ShardTensor

ArrayLike = np.ndarray | torch.Tensor


def _to_numpy(array: ArrayLike, name: str) -> np.ndarray:
    """A float64 numpy copy of an array or (plain) tensor."""
    if isinstance(array, ShardTensor):
        raise TypeError(
            f"{name} is a ShardTensor: call .full_tensor() on every rank first, then plot on one rank"
        )
    if isinstance(array, torch.Tensor):
        array = array.detach().to("cpu", torch.float64).numpy()
    return np.asarray(array, dtype=np.float64)


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(path, format="png")
    return path


def plot_prediction(
    prediction: ArrayLike,
    truth: ArrayLike,
    channel_names: Sequence[str],
    path: str | Path,
    title: str | None = None,
) -> Path:
    """Write a PNG with one row per channel and columns truth / prediction / error (prediction - truth).

    Truth and prediction share one colour scale per channel so they can be compared by eye; the
    error uses a diverging map centred on zero. Inputs are (C, H, W). Returns the path written.
    """
    prediction = _to_numpy(prediction, "prediction")
    truth = _to_numpy(truth, "truth")
    if prediction.ndim != 3 or prediction.shape != truth.shape:
        raise ValueError(
            f"prediction and truth must both be (C, H, W) of one shape, got {prediction.shape} and {truth.shape}"
        )
    if len(channel_names) != prediction.shape[0]:
        raise ValueError(f"got {len(channel_names)} channel names for {prediction.shape[0]} channels")
    channels, height, width = prediction.shape
    panel_width = 3.2
    panel_height = max(1.5, min(4.0, panel_width * height / width))
    figure = Figure(figsize=(3 * panel_width + 0.6, channels * panel_height + 0.6), dpi=100, layout="constrained")
    axes = figure.subplots(channels, 3, squeeze=False)
    error = prediction - truth
    for row, name in enumerate(channel_names):
        both = np.stack([truth[row], prediction[row]])
        low, high = float(np.nanmin(both)), float(np.nanmax(both))
        bound = float(np.nanmax(np.abs(error[row]))) or 1.0
        panels = [
            (truth[row], f"{name}: truth", {"cmap": "viridis", "vmin": low, "vmax": high}),
            (prediction[row], f"{name}: prediction", {"cmap": "viridis", "vmin": low, "vmax": high}),
            (error[row], f"{name}: error", {"cmap": "RdBu_r", "vmin": -bound, "vmax": bound}),
        ]
        for ax, (values, label, style) in zip(axes[row], panels):
            image = ax.imshow(values, origin="lower", interpolation="nearest", **style)
            ax.set_title(label, fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            figure.colorbar(image, ax=ax, shrink=0.8)
    if title:
        figure.suptitle(title)
    return _save(figure, path)


def power_spectrum(field: ArrayLike, *, average: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Isotropic power spectrum of an (H, W) field: power binned by |k| from its rfft2.

    Wavenumbers are integers in cycles per ``max(H, W)`` grid lengths (on a square grid, cycles
    per domain), assuming equal grid spacing in y and x; each Fourier mode goes to the bin nearest
    its |k|. Power per mode is ``|F|^2 / (H W)^2`` with rfft2's folded half-plane counted twice.

    ``average=True`` returns the mean power per mode in each annulus (the radially averaged
    spectrum); ``average=False`` the annulus sum, which satisfies Parseval:
    ``power.sum() == mean(field ** 2)``. Bins holding no mode are left out.
    """
    values = _to_numpy(field, "field")
    if values.ndim != 2:
        raise ValueError(f"power_spectrum takes one (H, W) field, got shape {values.shape}")
    height, width = values.shape
    scale = max(height, width)
    modes = np.abs(np.fft.rfft2(values)) ** 2 / (height * width) ** 2
    # columns 1 .. ceil(W/2)-1 stand for two conjugate modes each; column 0 and an even W's Nyquist once
    multiplicity = np.full(modes.shape[1], 2.0)
    multiplicity[0] = 1.0
    if width % 2 == 0:
        multiplicity[-1] = 1.0
    ky = np.fft.fftfreq(height)[:, None] * scale
    kx = np.fft.rfftfreq(width)[None, :] * scale
    bins = np.rint(np.hypot(ky, kx)).astype(np.int64).ravel()
    weights = np.broadcast_to(multiplicity, modes.shape).ravel()
    power = np.bincount(bins, weights=(modes * multiplicity).ravel())
    counts = np.bincount(bins, weights=weights)
    filled = counts > 0
    wavenumbers = np.arange(power.size, dtype=np.float64)[filled]
    power = power[filled]
    return wavenumbers, power / counts[filled] if average else power


def plot_spectra(fields: Mapping[str, ArrayLike], path: str | Path, title: str | None = None) -> Path:
    """Write a log-log PNG of the radially averaged spectrum of each named (H, W) field.

    The k = 0 bin (the field mean) has no place on a log axis and is left out.
    """
    if not fields:
        raise ValueError("plot_spectra needs at least one field")
    figure = Figure(figsize=(6.0, 4.5), dpi=100, layout="constrained")
    ax = figure.subplots()
    for name, field in fields.items():
        wavenumbers, power = power_spectrum(field)
        ax.loglog(wavenumbers[1:], power[1:], label=name)
    ax.set_xlabel("wavenumber (cycles per longer side)")
    ax.set_ylabel("power per mode")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    return _save(figure, path)
