"""The training loop of one stage: data parallel x domain parallel, checkpointed, logged.

Everything random is keyed by (seed, step, global sample index), never by rank or layout, so a
run on 1 x 1, 2 x 1 or 1 x 2 ranks follows the same trajectory and resumes on any layout.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..data import collate
from ..diffusion import derive_seed
from ..distributed import DistributedManager, collectives
from ..nn import ParallelModel, compile_in_place, default_fsdp_units, domain_mesh, parallelize
from ..nn.losses import replicated_value
from .checkpoint import Checkpointer, export_state_dict
from .data_setup import DataBundle, shard_batch
from .logger import RunLogger
from .metrics import rmse
from .optim import build_optimizer, build_scheduler
from .plots import plot_prediction, plot_spectra
from .task import Task

__all__ = ["StageResult", "Trainer", "check_grid_fits", "replica_sample_ids"]

log = logging.getLogger(__name__)


def check_grid_fits(height: int, domain_size: int, multiple: int) -> None:
    """Every domain rank must keep at least one row at the model's coarsest resolution, or the
    halo exchanges there would have no neighbour rows to send."""
    coarse = -(-height // multiple)
    if coarse < domain_size:
        raise ValueError(
            f"the grid has {height} rows, {coarse} at the model's coarsest level (1/{multiple}); that is too small for "
            f"parallel.domain_size={domain_size} (each domain rank needs at least one row there): use fewer domain "
            "ranks, a larger grid, or fewer U-Net levels"
        )


def replica_sample_ids(position: dict, steps_per_epoch: int, batch_size: int, data_rank: int, data_size: int) -> torch.Tensor:
    """Global indices of a data replica's samples in the stream of global micro-batches.

    They key the diffusion noise: domain ranks of a replica share them (one field, split), data
    replicas get disjoint ones, and the union over replicas does not depend on the layout.
    """
    micro = batch_size * data_size
    first = (position["epoch"] * steps_per_epoch + position["step"]) * micro + data_rank * batch_size
    return torch.arange(first, first + batch_size)


def _memory_mib() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class StageResult:
    model: torch.nn.Module  # the trained plain module (FSDP-sharded parameters under FSDP)
    steps: int
    losses: list[float] = field(default_factory=list)
    validation: dict[str, float] = field(default_factory=dict)
    exported: Path | None = None


class Trainer:
    """Runs ``task`` for ``cfg.training.max_steps`` optimizer steps in ``stage_dir``."""

    def __init__(self, cfg, task: Task, mesh: DeviceMesh, data: DataBundle, stage_dir: Path, logger: RunLogger):
        self.cfg, self.task, self.mesh, self.data = cfg, task, mesh, data
        self.stage_dir = Path(stage_dir)
        self.logger = logger
        self.domain = domain_mesh(mesh)
        self.data_group = mesh.get_group("data")
        self.data_rank = mesh.get_local_rank("data")
        self.data_size = mesh.size(mesh.mesh_dim_names.index("data"))
        self.device = DistributedManager().device

    # ----- pieces ------------------------------------------------------------------------------
    def _sample_ids(self, position: dict) -> torch.Tensor:
        loader = self.data.train_loader
        return replica_sample_ids(position, loader.steps_per_epoch, loader.batch_size, self.data_rank, self.data_size)

    def _replica_mean(self, value: torch.Tensor) -> float:
        return collectives.all_reduce(value.detach().reshape(1).double(), "avg", self.data_group).item()

    def _validation_batches(self):
        """The first ``validation_batches`` global batches of the validation split, in order
        (smaller batches than in training when the split is short)."""
        dataset = self.data.valid
        b = max(1, min(self.data.train_loader.batch_size, len(dataset) // self.data_size))
        micro = b * self.data_size
        for i in range(min(self.cfg.training.validation_batches, len(dataset) // micro)):
            first = i * micro + self.data_rank * b
            ids = torch.arange(first, first + b)
            yield ids, shard_batch(
                collate([dataset[int(j)] for j in ids]), self.domain, self.data.grid_shape, self.device, self.cfg.training.channels_last
            )

    # ----- validation ----------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, parallel: ParallelModel, step: int) -> dict[str, float]:
        seed = derive_seed(self.cfg.training.seed, 1 << 40)
        losses, errors, first = [], [], None
        for ids, batch in self._validation_batches():
            losses.append(replicated_value(self.task.loss(parallel, batch, seed=seed, sample_ids=ids)).float())
            prediction = self.task.predict(parallel, batch, seed=seed, sample_ids=ids)
            errors.append(replicated_value(rmse(prediction.float(), batch["target"], batch.get("mask"))))
            if first is None:
                first = (prediction, batch["target"])
        if not losses:
            return {}
        names = self.data.channel_names["state"]
        metrics = {"valid/loss": self._replica_mean(torch.stack(losses).mean())}
        per_channel = collectives.all_reduce(torch.stack(errors).mean(0).double(), "avg", self.data_group)
        metrics.update({f"valid/rmse_{name}": per_channel[i].item() for i, name in enumerate(names)})
        if self.cfg.logging.figures and first is not None:
            self._figures(first[0], first[1], names, step)
        return metrics

    def _figures(self, prediction: torch.Tensor, truth: torch.Tensor, names: list[str], step: int) -> None:
        # Collective: every domain rank joins the gather of the first sample; rank 0 draws it.
        prediction = prediction[:1].float().full_tensor()[0].cpu()
        truth = truth[:1].float().full_tensor()[0].cpu()
        if not self.logger.active:
            return
        figures = self.stage_dir / "figures"
        figures.mkdir(parents=True, exist_ok=True)
        path = plot_prediction(prediction, truth, names, figures / f"prediction_{step:06d}.png", title=f"{self.task.name} step {step}")
        spectra = plot_spectra(
            {"truth": truth[0], "prediction": prediction[0]}, figures / f"spectra_{step:06d}.png", title=f"{names[0]} power spectrum"
        )
        self.logger.log_image(f"{self.task.name}/prediction", path, step)
        self.logger.log_image(f"{self.task.name}/spectra", spectra, step)

    # ----- the loop ----------------------------------------------------------------------------
    def fit(self) -> StageResult:
        cfg, t = self.cfg, self.cfg.training
        torch.manual_seed(t.seed)  # identical initial weights on every rank (synced anyway)
        model = self.task.build_model().to(self.device)
        units = functools.partial(default_fsdp_units, min_params=cfg.parallel.fsdp_unit_params)
        parallel = parallelize(model, self.mesh, cfg.parallel.data_parallel, t.precision, fsdp_units=units)
        if t.compile:
            compile_in_place(parallel.model, t.compile_backend)
        optimizer = build_optimizer(cfg.optim, parallel.model.parameters())
        scheduler = build_scheduler(cfg.schedule, optimizer, t.max_steps)
        checkpoints = Checkpointer(self.stage_dir / "checkpoints", keep=t.keep_checkpoints)
        loader = self.data.train_loader
        start = 0
        if t.resume:
            state = checkpoints.load(parallel.model, optimizer, scheduler)
            if state is not None:
                start = state["step"]
                loader.load_state_dict(state["extra"]["train_loader"])
                log.info("%s: resumed from step %d in %s", self.task.name, start, checkpoints.directory)
        self.logger.forget_after(f"{self.task.name}/", start)  # a resumed stage logs its later steps again
        result = StageResult(parallel.model, start)
        if start >= t.max_steps:
            log.info("%s: already at step %d of %d", self.task.name, start, t.max_steps)
        batches = iter(loader)
        bar = self.logger.progress(t.max_steps, initial=start)
        step_samples = loader.batch_size * self.data_size * t.grad_accumulation
        # What setup built (modules, plans, configs, imported code) leaves the cyclic collector's
        # scans: a full collection of it took about 200 ms on each rank, a stalled step whenever one
        # fell inside the loop (7 ms frozen).  Setup's cyclic garbage goes first (a previous stage's
        # wrappers and optimizer, say), so none is held frozen; the stage unfreezes at its end.
        gc.collect()
        gc.freeze()
        try:
            for step in range(start, t.max_steps):
                began = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                total = torch.zeros((), device=self.device)
                for micro in range(t.grad_accumulation):
                    ids = self._sample_ids(loader.state_dict())
                    batch = shard_batch(next(batches), self.domain, self.data.grid_shape, self.device, t.channels_last)
                    with parallel.gradient_sync(micro == t.grad_accumulation - 1):  # the replicas reduce the sum once
                        # not keyed by the micro-batch: the sample ids place each sample in the run's stream
                        loss = self.task.loss(parallel, batch, seed=derive_seed(t.seed, step), sample_ids=ids)
                        (loss / t.grad_accumulation).backward()
                    total += loss.detach().float() / t.grad_accumulation
                norm = torch.nn.utils.clip_grad_norm_(parallel.model.parameters(), t.grad_clip or math.inf)
                optimizer.step()
                scheduler.step()
                loss_value = self._replica_mean(total)
                if not math.isfinite(loss_value):
                    raise FloatingPointError(
                        f"{self.task.name}: the loss is {loss_value} at step {step + 1}; check the data for NaNs "
                        "(missing values need a _FillValue) or lower optim.lr"
                    )
                result.losses.append(loss_value)
                done = step + 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4g}")
                if done % t.log_interval == 0 or done == t.max_steps:
                    seconds = time.perf_counter() - began
                    self.logger.log(
                        {
                            f"{self.task.name}/loss": loss_value,
                            f"{self.task.name}/lr": scheduler.get_last_lr()[0],
                            f"{self.task.name}/grad_norm": float(replicated_value(norm)),
                            f"{self.task.name}/samples_per_s": step_samples / seconds,
                            f"{self.task.name}/step_s": seconds,
                            f"{self.task.name}/max_memory_mib": _memory_mib(),
                        },
                        done,
                    )
                if done % t.validation_interval == 0 or done == t.max_steps:
                    result.validation = self.validate(parallel, done)
                    self.logger.log({f"{self.task.name}/{k}": v for k, v in result.validation.items()}, done)
                if done % t.checkpoint_interval == 0 or done == t.max_steps:
                    checkpoints.save(done, parallel.model, optimizer, scheduler, extra={"train_loader": loader.state_dict()})
                result.steps = done
        finally:
            gc.unfreeze()
            bar.close()
            loader.close()
        result.exported = self.stage_dir / "model.pt"
        export_state_dict(parallel.model, result.exported)
        return result
