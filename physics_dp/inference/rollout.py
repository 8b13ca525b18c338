"""The forecast loop: one batch of ensemble members per lead step, sharded over the grid.

Members are the batch dim. Domain ranks split the grid rows; data ranks (if any) split the members
and gather them after each step. Diffusion noise is keyed by (seed, lead step) and each member's
global index, so every layout draws the single-process numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..data import WeatherDataset, collate
from ..diffusion import derive_seed
from ..distributed import collectives
from ..nn import domain_mesh
from ..shard_tensor import ShardTensor
from ..training.data_setup import FIELD_KEYS, shard_batch
from .loading import Predictor

__all__ = ["LeadStep", "Rollout"]


@dataclass
class LeadStep:
    """Everything about one lead step, normalized; fields are ShardTensors over the domain mesh."""

    lead_step: int  # 1, 2, ...
    time_index: int  # global time index of the valid time
    ensemble: torch.Tensor  # (E, C, H, W): every member
    truth: torch.Tensor  # (1, C, H, W)
    mask: torch.Tensor  # (1, C, H, W) bool, True where the truth is valid


class Rollout:
    """Forecasts from the validation split with ``predictor`` on a ("data", "domain") mesh."""

    def __init__(
        self,
        predictor: Predictor,
        dataset: WeatherDataset,
        mesh: DeviceMesh,
        grid: tuple[int, int],
        members: int,
        seed: int,
        device: torch.device | str = "cpu",
        channels_last: bool = False,
    ):
        data_size = mesh.size(mesh.mesh_dim_names.index("data"))
        if members % data_size:
            raise ValueError(
                f"members={members} does not divide over the {data_size} data-parallel ranks (world size / domain_size); "
                f"use a multiple of {data_size} members or domain_size=<world size>"
            )
        if members > 1 and not predictor.stochastic:
            raise ValueError(
                f"members={members} but the run has no diffusion model ({predictor.task.name} only), so every member "
                "would be identical; use members=1 or train the diffusion stage (training.stage=both)"
            )
        self.predictor, self.dataset, self.grid, self.members, self.seed = predictor, dataset, grid, members, seed
        self.channels_last = channels_last  # the fields' layout, as the trainer's (training.channels_last)
        self.device = torch.device(device)
        self.domain = domain_mesh(mesh)
        self.data_group = mesh.get_group("data")
        self.data_size = data_size
        per_rank = members // data_size
        first = mesh.get_local_rank("data") * per_rank
        self.member_ids = torch.arange(first, first + per_rank)

    def check_range(self, start: int, steps: int) -> None:
        """Every lead step needs its background and truth from the validation split."""
        lead, available = self.dataset.spec.lead_time, len(self.dataset)
        last = start + (steps - 1) * lead
        if last >= available:
            raise ValueError(
                f"start_time={start} with steps={steps} (lead_time={lead}) needs validation sample {last}, but the "
                f"validation split has {available} samples (data.valid_times={self.dataset.spec.valid_times}); "
                "lower steps or start_time, or widen data.valid_times"
            )

    def _batch(self, index: int, copies: int) -> dict[str, torch.Tensor]:
        sample = collate([self.dataset[index]])
        local = {k: v.repeat(copies, *[1] * (v.ndim - 1)).to(self.device) if k in FIELD_KEYS else v for k, v in sample.items()}
        return shard_batch(local, self.domain, self.grid, channels_last=self.channels_last)

    def _gather_members(self, prediction: torch.Tensor) -> torch.Tensor:
        if self.data_size == 1:
            return prediction
        local = prediction.to_local()
        every = collectives.all_gather_along_dim(local, [local.shape[0]] * self.data_size, 0, self.data_group)
        return ShardTensor.from_local(every, self.domain, prediction.placements, sharding_shapes="infer")

    @torch.no_grad()
    def run(self, start: int, steps: int) -> Iterator[LeadStep]:
        """Yield each lead step in order; StormCast feeds each member's prediction back as its next state."""
        self.check_range(start, steps)
        lead = self.dataset.spec.lead_time
        state: torch.Tensor | None = None
        for k in range(steps):
            index = start + k * lead
            inputs = self._batch(index, len(self.member_ids))
            truth = self._batch(index, 1)
            if self.predictor.rolls_out and state is not None:
                inputs["state"] = state
            inputs["target"] = torch.zeros_like(inputs["state"])  # the shape of a sample; the truth stays out
            prediction = self.predictor.predict(inputs, derive_seed(self.seed, k), self.member_ids)
            state = prediction
            yield LeadStep(
                lead_step=k + 1,
                time_index=int(truth["time_index"][0]) + lead,
                ensemble=self._gather_members(prediction),
                truth=truth["target"],
                mask=truth["mask"],
            )
