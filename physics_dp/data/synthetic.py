"""A small synthetic HRRR/ERA5-like dataset in CF netCDF, with dynamics a model can learn.

Winds come from a stream function of a mean flow plus drifting Gaussian vortices; 2 m temperature
is advected by that wind (semi-Lagrangian), diffused, and relaxed towards an equilibrium set by
orography, latitude and a diurnal cycle over land. The background is the state block-averaged onto
a grid 4x coarser plus a smooth perturbation; invariants are orography and the land-sea mask.
The files exercise the reader: time split over several files, a singleton level dim on v10m, and
a `_FillValue` rectangle of missing t2m over the sea every sixth step.

CLI: ``python -m physics_dp.data.synthetic --out DIR [--times N --height H --width W --seed S]``
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
from dataclasses import asdict, dataclass

import netCDF4
import numpy as np

from .files import open_dataset

STATE_VARIABLES = ["u10m", "v10m", "t2m"]
BACKGROUND_VARIABLES = ["u10", "v10", "t2m"]
INVARIANT_VARIABLES = ["orography", "land_sea_mask"]
TIME_UNITS = "hours since 2020-01-01 00:00:00"
FILL_VALUE = np.float32(-9999.0)
DX_KM = 10.0
COARSEN = 4
SUBSTEPS = 2
MARKER = "synthetic_complete.json"

_ATTRS = {
    "u10m": ("m s-1", "10 metre eastward wind"),
    "v10m": ("m s-1", "10 metre northward wind"),
    "t2m": ("K", "2 metre temperature"),
    "u10": ("m s-1", "10 metre eastward wind (background)"),
    "v10": ("m s-1", "10 metre northward wind (background)"),
    "orography": ("m", "surface height above sea level"),
    "land_sea_mask": ("1", "land fraction"),
}


@dataclass(frozen=True)
class SyntheticPaths:
    """Where the files are and which variables they hold."""

    root: str
    state_glob: str
    background_glob: str
    invariant_file: str
    state_variables: list[str]
    background_variables: list[str]
    invariant_variables: list[str]


def _invariants(h: int, w: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Orography (m) and land fraction: land east of a wavy coast, Gaussian mountains on land."""
    yy, xx = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
    coast = w * (0.35 + 0.06 * np.sin(2 * np.pi * yy / h * 1.5 + rng.uniform(0, 2 * np.pi)))
    land = np.clip((xx - coast) / (0.05 * w) + 0.5, 0.0, 1.0)
    hills = np.zeros((h, w))
    for _ in range(3):
        cy, cx = rng.uniform(0.15 * h, 0.85 * h), rng.uniform(0.55 * w, 0.9 * w)
        radius = rng.uniform(0.08, 0.18) * min(h, w)
        hills += rng.uniform(600, 1800) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * radius**2))
    return hills * land, land


class _Winds:
    """Divergence-free winds (grid cells per hour) from a stream function of drifting vortices."""

    def __init__(self, h: int, w: int, rng: np.random.Generator) -> None:
        self.yy, self.xx = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
        self.mean = rng.uniform(-0.4, 0.8, size=2)
        n = 3
        self.centre = np.stack([rng.uniform(0.2 * h, 0.8 * h, n), rng.uniform(0.2 * w, 0.8 * w, n)], axis=1)
        self.swing = np.stack([rng.uniform(0.05, 0.15, n) * h, rng.uniform(0.05, 0.15, n) * w], axis=1)
        self.radius = rng.uniform(0.1, 0.2, n) * min(h, w)
        self.strength = rng.choice([-1.0, 1.0], n) * rng.uniform(1.0, 2.0, n) * self.radius / 0.6
        self.period = rng.uniform(24.0, 72.0, n)
        self.phase = rng.uniform(0, 2 * np.pi, n)

    def __call__(self, hours: float) -> tuple[np.ndarray, np.ndarray]:
        psi = self.mean[1] * self.xx - self.mean[0] * self.yy
        angle = 2 * np.pi * hours / self.period + self.phase
        for k in range(len(self.radius)):
            cy = self.centre[k, 0] + self.swing[k, 0] * np.sin(angle[k])
            cx = self.centre[k, 1] + self.swing[k, 1] * np.cos(angle[k])
            r2 = (self.yy - cy) ** 2 + (self.xx - cx) ** 2
            psi = psi + self.strength[k] * np.exp(-r2 / (2 * self.radius[k] ** 2))
        dpsi_dy, dpsi_dx = np.gradient(psi)
        return -dpsi_dy, dpsi_dx


def _bilinear_sample(field: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sample `field` at fractional grid positions, clamped to the edges."""
    h, w = field.shape
    y = np.clip(y, 0, h - 1)
    x = np.clip(x, 0, w - 1)
    y0 = np.minimum(np.floor(y).astype(np.int64), h - 2)
    x0 = np.minimum(np.floor(x).astype(np.int64), w - 2)
    fy, fx = y - y0, x - x0
    top = (1 - fx) * field[y0, x0] + fx * field[y0, x0 + 1]
    bottom = (1 - fx) * field[y0 + 1, x0] + fx * field[y0 + 1, x0 + 1]
    return (1 - fy) * top + fy * bottom


def _laplacian(field: np.ndarray) -> np.ndarray:
    p = np.pad(field, 1, mode="edge")
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * field


def _simulate(n_times: int, h: int, w: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    orography, land = _invariants(h, w, rng)
    winds = _Winds(h, w, rng)
    yy, xx = winds.yy, winds.xx

    def equilibrium(hours: float) -> np.ndarray:
        diurnal = 4.0 * land * np.sin(2 * np.pi * (hours - 9.0) / 24.0)
        return 292.0 - 0.0065 * orography - 10.0 * yy / h + diurnal

    dt = 1.0 / SUBSTEPS
    temperature = equilibrium(0.0) + 1.5 * np.sin(2 * np.pi * (xx / w * 2 + rng.uniform())) * np.cos(2 * np.pi * yy / h)
    out = {name: np.empty((n_times, h, w)) for name in STATE_VARIABLES}
    cells_per_hour_to_ms = DX_KM * 1000.0 / 3600.0
    for step in range(n_times):
        u, v = winds(float(step))
        out["u10m"][step] = u * cells_per_hour_to_ms
        out["v10m"][step] = v * cells_per_hour_to_ms
        out["t2m"][step] = temperature
        for sub in range(SUBSTEPS):
            hours = step + sub * dt
            u, v = winds(hours)
            temperature = _bilinear_sample(temperature, yy - v * dt, xx - u * dt)
            temperature += dt * (0.15 * _laplacian(temperature) + (equilibrium(hours) - temperature) / 12.0)
    out["orography"], out["land_sea_mask"] = orography, land
    return out


def _coarsen(field: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """Block mean over COARSEN+1 points centred on every COARSEN-th point (edges clamped)."""
    n = field.shape[axis]
    half = COARSEN // 2
    index = np.clip(COARSEN * np.arange(n_out)[:, None] + np.arange(-half, half + 1)[None, :], 0, n - 1)
    return np.take(field, index, axis=axis).mean(axis=axis + 1)


def _background(state: dict[str, np.ndarray], hb: int, wb: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n_times = state["t2m"].shape[0]
    yb, xb = np.meshgrid(np.arange(hb) / hb, np.arange(wb) / wb, indexing="ij")
    hours = np.arange(n_times, dtype=np.float64)[:, None, None]
    out = {}
    for name, source, amplitude in (("u10", "u10m", 0.5), ("v10", "v10m", 0.5), ("t2m", "t2m", 1.0)):
        coarse = _coarsen(_coarsen(state[source], hb, 1), wb, 2)
        k = rng.uniform(0.5, 1.5, size=2)
        phase = rng.uniform(0, 2 * np.pi)
        out[name] = coarse + amplitude * np.sin(2 * np.pi * (k[0] * yb + k[1] * xb + hours / 24.0) + phase)
    return out


def _add_coords(ds: netCDF4.Dataset, h: int, w: int, spacing_km: float) -> None:
    ds.createDimension("y", h)
    ds.createDimension("x", w)
    for name, size, axis in (("y", h, "Y"), ("x", w, "X")):
        coord = ds.createVariable(name, "f8", (name,))
        coord[:] = np.arange(size) * spacing_km
        coord.units = "km"
        coord.axis = axis
        coord.standard_name = f"projection_{name}_coordinate"


def _add_time(ds: netCDF4.Dataset, hours: np.ndarray) -> None:
    ds.createDimension("time", len(hours))
    time = ds.createVariable("time", "f8", ("time",))
    time[:] = hours
    time.units = TIME_UNITS
    time.calendar = "standard"
    time.axis = "T"
    time.standard_name = "time"


def _add_variable(ds: netCDF4.Dataset, name: str, dims: tuple[str, ...], data: np.ndarray, fill: bool = False) -> None:
    var = ds.createVariable(name, "f4", dims, fill_value=FILL_VALUE if fill else None)
    var.units, var.long_name = _ATTRS[name]
    var[:] = data.astype(np.float32)


def _missing_t2m(n_times: int, h: int, w: int) -> np.ndarray:
    """A small rectangle over the sea (west of the coast) missing every sixth step."""
    missing = np.zeros((n_times, h, w), dtype=bool)
    rows = slice(h // 4, h // 4 + max(2, h // 16))
    cols = slice(1, 1 + max(2, w // 16))
    missing[3::6, rows, cols] = True
    return missing


def _write_state(path: str, fields: dict[str, np.ndarray], hours: np.ndarray, missing: np.ndarray) -> None:
    h, w = fields["t2m"].shape[1:]
    with open_dataset(path, "w") as ds:
        ds.Conventions = "CF-1.8"
        ds.title = "physics_dp synthetic HRRR-like state"
        _add_time(ds, hours)
        ds.createDimension("level", 1)
        level = ds.createVariable("level", "f8", ("level",))
        level[:] = [10.0]
        level.units = "m"
        level.long_name = "height above ground"
        _add_coords(ds, h, w, DX_KM)
        _add_variable(ds, "u10m", ("time", "y", "x"), fields["u10m"])
        _add_variable(ds, "v10m", ("time", "level", "y", "x"), fields["v10m"][:, None])
        _add_variable(ds, "t2m", ("time", "y", "x"), np.where(missing, FILL_VALUE, fields["t2m"]), fill=True)


def _write_background(path: str, fields: dict[str, np.ndarray], hours: np.ndarray) -> None:
    hb, wb = fields["t2m"].shape[1:]
    with open_dataset(path, "w") as ds:
        ds.Conventions = "CF-1.8"
        ds.title = "physics_dp synthetic ERA5-like background"
        _add_time(ds, hours)
        _add_coords(ds, hb, wb, DX_KM * COARSEN)
        for name in BACKGROUND_VARIABLES:
            _add_variable(ds, name, ("time", "y", "x"), fields[name])


def _write_invariants(path: str, fields: dict[str, np.ndarray]) -> None:
    h, w = fields["orography"].shape
    with open_dataset(path, "w") as ds:
        ds.Conventions = "CF-1.8"
        ds.title = "physics_dp synthetic invariants"
        _add_coords(ds, h, w, DX_KM)
        for name in INVARIANT_VARIABLES:
            _add_variable(ds, name, ("y", "x"), fields[name])


def _write_all(root: str, params: dict, files_per_split: int) -> None:
    n_times, h, w, seed = params["n_times"], params["height"], params["width"], params["seed"]
    fields = _simulate(n_times, h, w, seed)
    hb, wb = -(-(h - 1) // COARSEN) + 1, -(-(w - 1) // COARSEN) + 1
    background = _background(fields, hb, wb, np.random.default_rng([seed, 1]))
    missing = _missing_t2m(n_times, h, w)
    hours = np.arange(n_times, dtype=np.float64)
    tag = f".tmp-{os.getpid()}"
    written = []
    for k, part in enumerate(np.array_split(np.arange(n_times), files_per_split)):
        chunk = slice(int(part[0]), int(part[-1]) + 1)
        state_path = os.path.join(root, f"state_{k:03d}.nc")
        background_path = os.path.join(root, f"background_{k:03d}.nc")
        _write_state(state_path + tag, {n: fields[n][chunk] for n in STATE_VARIABLES}, hours[chunk], missing[chunk])
        _write_background(background_path + tag, {n: background[n][chunk] for n in BACKGROUND_VARIABLES}, hours[chunk])
        written += [state_path, background_path]
    invariant_path = os.path.join(root, "invariants.nc")
    _write_invariants(invariant_path + tag, fields)
    written.append(invariant_path)
    for path in written:
        os.replace(path + tag, path)
    with open(os.path.join(root, MARKER) + tag, "w") as f:
        json.dump(params, f)
    os.replace(os.path.join(root, MARKER) + tag, os.path.join(root, MARKER))


def write_synthetic_dataset(
    out_dir: str | os.PathLike,
    *,
    n_times: int = 48,
    height: int = 64,
    width: int = 96,
    seed: int = 0,
    files_per_split: int = 2,
) -> SyntheticPaths:
    """Write the dataset into `out_dir` unless a complete one with the same parameters is there.

    Concurrent callers serialize on a lock file; files are written under temporary names and
    renamed, and a marker written last says the set is complete.
    """
    if n_times < 2 or height < 2 or width < 2:
        raise ValueError(f"n_times={n_times}, height={height}, width={width}: each must be at least 2")
    if not 1 <= files_per_split <= n_times:
        raise ValueError(f"files_per_split={files_per_split} must be between 1 and n_times={n_times}")
    root = os.path.abspath(os.fspath(out_dir))
    os.makedirs(root, exist_ok=True)
    params = {"n_times": n_times, "height": height, "width": width, "seed": seed, "files_per_split": files_per_split}
    with open(os.path.join(root, ".synthetic.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = os.path.join(root, MARKER)
        if os.path.exists(marker):
            with open(marker) as f:
                existing = json.load(f)
            if existing != params:
                raise ValueError(
                    f"{root} already holds a synthetic dataset written with {existing}, not {params}; "
                    "use another out_dir or delete that one"
                )
        else:
            _write_all(root, params, files_per_split)
    return SyntheticPaths(
        root=root,
        state_glob=os.path.join(root, "state_*.nc"),
        background_glob=os.path.join(root, "background_*.nc"),
        invariant_file=os.path.join(root, "invariants.nc"),
        state_variables=list(STATE_VARIABLES),
        background_variables=list(BACKGROUND_VARIABLES),
        invariant_variables=list(INVARIANT_VARIABLES),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the physics_dp synthetic netCDF dataset.")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--times", type=int, default=48)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--files-per-split", type=int, default=2)
    args = parser.parse_args(argv)
    paths = write_synthetic_dataset(
        args.out, n_times=args.times, height=args.height, width=args.width, seed=args.seed,
        files_per_split=args.files_per_split,
    )
    print(json.dumps(asdict(paths), indent=1))


if __name__ == "__main__":
    main()
