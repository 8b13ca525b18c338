"""``python -m physics_dp.infer run_dir=PATH [steps=N] [members=M] [start_time=T] [out=DIR] ...``
(also under ``torchrun --nproc-per-node N -m physics_dp.infer``).

Forecasts from a finished training run on the validation split, the grid split over
``domain_size`` ranks (default: all of them; the remaining ranks split the ensemble members):
StormCast rolls out ``steps`` lead steps from the state at ``start_time`` (regression mean plus,
with a diffusion model, one residual sample per member and step); the diffusion recipe draws
``members`` samples per valid time. Writes, on rank 0, ``OUT/forecast.nc`` (CF-1.8, physical
units, an ``ensemble`` dim when members > 1), ``OUT/scores.json`` (RMSE of the ensemble mean and,
with members > 1, spread and CRPS per variable and lead step) and ``OUT/figures/step_NNN.png``.
Every other ``section.key=value`` overrides the run's config.yaml, e.g. ``sampling.num_steps=8``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .data import WeatherDataset
from .data.cf_writer import ForecastWriter
from .distributed import DistributedManager
from .inference import (
    InferConfig,
    Rollout,
    ScoreTable,
    SourceInfo,
    describe_sources,
    load_predictor,
    load_run_config,
    parse_args,
    score_step,
)
from .inference.options import check
from .recipes import Channels
from .training.data_setup import data_spec, row_window, shared_stats
from .training.logger import setup_console_logging
from .training.plots import plot_prediction

__all__ = ["InferenceResult", "infer", "main"]

log = logging.getLogger(__name__)


@dataclass
class InferenceResult:
    """What a run wrote (paths on rank 0) and its scores (on every rank)."""

    out_dir: Path
    forecast: Path
    scores: dict
    table: str  # the scores as printed
    figures: list[Path] = field(default_factory=list)


def _layout(world_size: int, domain_size: int | None) -> tuple[int, int]:
    domain = domain_size or world_size
    if world_size % domain:
        raise ValueError(f"domain_size={domain} does not divide the world size {world_size}; choose a divisor of {world_size}")
    return world_size // domain, domain


def _physical(field: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return field * std + mean


def infer(options: InferConfig, overrides: Sequence[str] = ()) -> InferenceResult:
    """Run one forecast as ``options`` says; every rank calls it (it is collective)."""
    check(options)
    DistributedManager.initialize()
    manager = DistributedManager()
    run_dir = Path(options.run_dir).absolute()
    cfg = load_run_config(run_dir, overrides)
    data_size, domain_size = _layout(manager.world_size, options.domain_size)
    mesh = manager.initialize_mesh((data_size, domain_size), ("data", "domain"))
    out_dir = Path(options.out or run_dir / "inference").absolute()
    spec = data_spec(cfg.data)
    stats = shared_stats(spec)
    sources = describe_sources(spec)
    grid = sources.shape
    if grid[0] < domain_size:
        raise ValueError(f"the grid has {grid[0]} rows, fewer than domain_size={domain_size}; use fewer domain ranks")
    rows = row_window(grid[0], domain_size, mesh.get_local_rank("domain"))
    dataset = WeatherDataset(spec, "valid", rows=rows, stats=stats)
    try:
        names = dataset.channel_names["state"]
        predictor = load_predictor(cfg, run_dir, Channels.from_names(dataset.channel_names), grid, domain_size, manager.device)
        rollout = Rollout(
            predictor, dataset, mesh, grid, options.members, options.seed, manager.device, cfg.training.channels_last
        )
        rollout.check_range(options.start_time, options.steps)
        group = stats.groups["state"]
        mean = torch.tensor(group.mean, dtype=torch.float32, device=manager.device).view(1, -1, 1, 1)
        std = torch.tensor(group.std, dtype=torch.float32, device=manager.device).view(1, -1, 1, 1)
        initial = int(dataset[options.start_time]["time_index"])
        log.info(
            "%s forecast: %d lead steps x %d members from %s on %d data x %d domain ranks",
            cfg.task, options.steps, options.members, sources.time(initial), data_size, domain_size,
        )
        return _forecast(options, rollout, sources, names, mean, std, initial, out_dir, manager.rank == 0)
    finally:
        dataset.close()


def _agree_on_writer(failure: Exception | None, forecast: Path) -> None:
    """Raise on every rank when rank 0 could not open the output file."""
    message = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    if failure is not None:
        raise failure
    if message[0] is not None:
        raise RuntimeError(f"rank 0 could not create {forecast} ({message[0]}); choose a writable out=DIR")


def _forecast(
    options: InferConfig,
    rollout: Rollout,
    sources: SourceInfo,
    names: list[str],
    mean: torch.Tensor,
    std: torch.Tensor,
    initial: int,
    out_dir: Path,
    writes: bool,
) -> InferenceResult:
    """The loop: score sharded on every rank; gather each step; rank 0 writes and draws it."""
    table = ScoreTable(names, options.members)
    figures: list[Path] = []
    forecast = out_dir / "forecast.nc"
    ensemble_size = options.members if options.members > 1 else None
    writer, failure = None, None
    if writes:
        try:
            writer = ForecastWriter(
                forecast, names, reference_time=sources.time(initial), units=sources.units,
                variable_attrs=sources.variable_attrs, grid=sources.grid, calendar=sources.calendar,
                time_units=sources.time_units, time_name=sources.time_name, ensemble_size=ensemble_size, title="physics_dp forecast",
                attrs={"source_run": str(Path(options.run_dir).absolute()), "members": options.members, "seed": options.seed},
            )
        except Exception as error:  # the other ranks must hear of it, not wait in the rollout's collectives
            failure = error
    _agree_on_writer(failure, forecast)
    try:
        for step in rollout.run(options.start_time, options.steps):
            ensemble = _physical(step.ensemble, mean, std)
            truth = _physical(step.truth, mean, std)
            valid_time = sources.time(step.time_index)
            table.add(step.lead_step, valid_time.isoformat(), score_step(ensemble, truth, step.mask))
            ensemble, truth, mask = ensemble.full_tensor().cpu(), truth.full_tensor().cpu(), step.mask.full_tensor().cpu()
            if writer is None:
                continue
            ensemble = torch.where(mask, ensemble, torch.nan)  # the source's missing points stay missing (_FillValue)
            fields = {name: ensemble[:, c] if ensemble_size else ensemble[0, c] for c, name in enumerate(names)}
            writer.write(valid_time, fields)
            if options.figures:
                figures.append(
                    plot_prediction(
                        ensemble[0], torch.where(mask[0], truth[0], torch.nan), names,
                        out_dir / "figures" / f"step_{step.lead_step:03d}.png",
                        title=f"lead step {step.lead_step}, valid {valid_time:%Y-%m-%d %H:%M} (member 0)",
                    )
                )
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
        table.write(out_dir / "scores.json")
    return InferenceResult(out_dir, forecast, table.to_json(), table.format(), figures)


def main(argv: Sequence[str] | None = None) -> None:
    options, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    DistributedManager.initialize()
    manager = DistributedManager()
    setup_console_logging(manager.rank)
    try:
        result = infer(options, overrides)
        if manager.rank == 0:
            print(result.table)
            print(f"wrote {result.forecast}, {result.out_dir / 'scores.json'} and {len(result.figures)} figure(s)")
    finally:
        manager.cleanup()


if __name__ == "__main__":
    main()
