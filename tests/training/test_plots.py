"""Figures are real PNGs of sensible size; the power spectrum puts a pure wave at its wavenumber and obeys Parseval."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from physics_dp.training.plots import plot_prediction, plot_spectra, power_spectrum

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature."""
    header = path.read_bytes()[:24]
    assert header[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


def _assert_has_content(path) -> None:
    pixels = imread(path)
    assert pixels.std() > 0.05, f"{path} looks blank"


def _wave(height: int, width: int, ky: int, kx: int) -> np.ndarray:
    y, x = np.meshgrid(np.arange(height) / height, np.arange(width) / width, indexing="ij")
    return np.sin(2 * np.pi * (ky * y + kx * x) + 0.3)


def test_plot_prediction_png_rows_per_channel(tmp_path):
    rng = np.random.default_rng(0)
    truth = rng.standard_normal((3, 24, 32))
    prediction = torch.from_numpy(truth + 0.1 * rng.standard_normal((3, 24, 32))).float()
    three = plot_prediction(prediction, truth, ["u10", "v10", "t2m"], tmp_path / "sub" / "three.png", title="step 10")
    one = plot_prediction(prediction[:1], truth[:1], ["u10"], tmp_path / "one.png")
    (width3, height3), (width1, height1) = _png_size(three), _png_size(one)
    assert width3 == width1 and 800 <= width3 <= 1200
    assert height3 > 2 * height1 and height1 >= 150
    _assert_has_content(three)


def test_plot_prediction_checks_shapes(tmp_path):
    field = np.zeros((2, 8, 8))
    with pytest.raises(ValueError, match="channel names"):
        plot_prediction(field, field, ["only one"], tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        plot_prediction(field, field[:1], ["a", "b"], tmp_path / "x.png")


@pytest.mark.parametrize(
    "height, width, ky, kx, expected",
    [
        (64, 64, 0, 5, 5),
        (64, 64, 7, 0, 7),
        (64, 64, 3, 4, 5),  # diagonal wave: |k| = 5
        (32, 64, 0, 4, 4),  # along the long side: 4 cycles per 64 lengths
        (32, 64, 4, 0, 8),  # along the short side: 4 cycles per 32 lengths = 8 per 64
        (45, 45, 0, 22, 22),  # odd extents, just below Nyquist
    ],
)
def test_spectrum_of_a_pure_wave_peaks_at_its_wavenumber(height, width, ky, kx, expected):
    for average in (True, False):
        wavenumbers, power = power_spectrum(_wave(height, width, ky, kx), average=average)
        assert wavenumbers[np.argmax(power)] == expected
        # a unit sine carries mean square 1/2, all of it in that one bin
        if not average:
            assert power[wavenumbers == expected][0] == pytest.approx(0.5)


@pytest.mark.parametrize("shape", [(32, 32), (31, 20), (16, 17), (1, 8)])
def test_parseval(shape):
    field = np.random.default_rng(1).standard_normal(shape) + 0.7
    wavenumbers, power = power_spectrum(torch.from_numpy(field), average=False)
    assert power.sum() == pytest.approx(np.mean(field**2), rel=1e-12)
    assert np.all(np.diff(wavenumbers) > 0)


@pytest.mark.parametrize("shape", [(16, 16), (12, 21)])
def test_average_is_power_per_mode(shape):
    """A point impulse has |F|^2 = 1 for every mode, so its radially averaged spectrum is flat."""
    impulse = np.zeros(shape)
    impulse[0, 0] = 1.0
    _, power = power_spectrum(impulse)
    np.testing.assert_allclose(power, 1.0 / (shape[0] * shape[1]) ** 2, rtol=1e-12)


def test_power_spectrum_needs_2d():
    with pytest.raises(ValueError, match=r"\(H, W\)"):
        power_spectrum(np.zeros((2, 8, 8)))


def test_plot_spectra_png(tmp_path):
    rng = np.random.default_rng(2)
    fields = {"truth": rng.standard_normal((32, 32)), "prediction": torch.randn(32, 32)}
    path = plot_spectra(fields, tmp_path / "spectra.png", title="spectra")
    assert _png_size(path) == (600, 450)
    _assert_has_content(path)
    with pytest.raises(ValueError, match="at least one"):
        plot_spectra({}, tmp_path / "none.png")
