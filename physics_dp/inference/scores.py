"""Forecast scores per variable and lead step, computed on the sharded fields.

Why the masking trick: ``crps_ensemble`` and ``ensemble_spread`` average over every point, but the
truth has missing points. Setting every member equal to the truth there makes each such point
contribute exactly zero, so rescaling the all-point mean by (points / valid points) gives the mean
over valid points, with the same sharded ops.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from ..training.metrics import crps_ensemble, ensemble_spread, rmse

__all__ = ["ScoreTable", "score_step"]


def _plain(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def score_step(ensemble: torch.Tensor, truth: torch.Tensor, mask: torch.Tensor) -> dict[str, list[float]]:
    """RMSE of the ensemble mean, and with 2+ members spread and CRPS, per channel.

    ``ensemble`` is (E, C, H, W), ``truth`` and ``mask`` (1, C, H, W) (mask True where the truth is
    valid), all in physical units; collective when they are ShardTensors.
    """
    scores = {"rmse": _plain(rmse(ensemble.mean(dim=0, keepdim=True), truth, mask)).tolist()}
    if ensemble.shape[0] < 2:
        return scores
    members = torch.where(mask, ensemble, truth)  # masked points: every member equals the truth
    total = mask.shape[2] * mask.shape[3]
    valid = _plain(mask.to(ensemble.dtype).sum(dim=(0, 2, 3)))
    scale = total / valid.clamp_min(1)
    spread = _plain(ensemble_spread(members.unsqueeze(1)))
    crps = _plain(crps_ensemble(members.unsqueeze(1), truth))
    scores["spread"] = (spread * scale.sqrt()).where(valid > 0, math.nan).tolist()
    scores["crps"] = (crps * scale).where(valid > 0, math.nan).tolist()
    return scores


class ScoreTable:
    """Scores of every lead step, written as ``scores.json`` and printed as a small table."""

    def __init__(self, variables: Sequence[str], members: int) -> None:
        self.variables = list(variables)
        self.members = members
        self.lead_steps: list[int] = []
        self.valid_times: list[str] = []
        self.scores: dict[str, dict[str, list[float]]] = {}

    def add(self, lead_step: int, valid_time: str, scores: dict[str, list[float]]) -> None:
        self.lead_steps.append(lead_step)
        self.valid_times.append(valid_time)
        for metric, values in scores.items():
            for name, value in zip(self.variables, values):
                self.scores.setdefault(metric, {}).setdefault(name, []).append(float(value))

    def to_json(self) -> dict:
        return {
            "variables": self.variables,
            "members": self.members,
            "lead_steps": self.lead_steps,
            "valid_times": self.valid_times,
            "units": "physical units of each variable",
            **self.scores,
        }

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def format(self) -> str:
        """One row per lead step, one column per (metric, variable)."""
        columns = [(metric, name) for metric in self.scores for name in self.variables]
        header = ["step", "valid time"] + [f"{metric} {name}" for metric, name in columns]
        rows = [
            [str(step), time] + [f"{self.scores[metric][name][i]:.4g}" for metric, name in columns]
            for i, (step, time) in enumerate(zip(self.lead_steps, self.valid_times))
        ]
        widths = [max(len(row[j]) for row in [header, *rows]) for j in range(len(header))]
        return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows])
