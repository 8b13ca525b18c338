"""Per-channel forecast scores: RMSE, ensemble spread and ensemble CRPS.

Every score is built from pointwise ops, a sort over the (never sharded) ensemble dim and means
over the batch and spatial dims. Those are exactly the ops physics_dp runs sharded, and its
reductions over a sharded dim are global, so the same functions score ShardTensors split over
H (or W) and return the single-device value as a replicated (C,) ShardTensor.

Layouts: fields are (N, C, H, W); ensembles are (E, N, C, H, W) with the members on dim 0.
"""

from __future__ import annotations

import torch

_FIELD_DIMS = (0, 2, 3)  # N, H, W of an (N, C, H, W) field: everything but the channel


def _check_field(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout} ({ndim}-D), got shape {tuple(tensor.shape)}")


def _check_same_shape(name: str, tensor: torch.Tensor, reference: torch.Tensor, reference_name: str) -> None:
    if tensor.shape != reference.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {reference_name} has {tuple(reference.shape)}; "
            "they must match element for element"
        )


def rmse(prediction: torch.Tensor, truth: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Root-mean-square error per channel over (N, H, W) of (N, C, H, W) fields.

    ``mask`` (bool, same shape) selects the points that count, e.g. ocean only. Masked-out points
    are replaced rather than multiplied away, so NaNs there (land in an ocean field) do not leak.
    A channel with no selected point scores NaN.
    """
    _check_field("prediction", prediction, 4, "(N, C, H, W)")
    _check_same_shape("truth", truth, prediction, "prediction")
    squared = (prediction - truth) ** 2
    if mask is None:
        return squared.mean(dim=_FIELD_DIMS).sqrt()
    _check_same_shape("mask", mask, prediction, "prediction")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = point counts), got dtype {mask.dtype}")
    total = torch.where(mask, squared, 0.0).sum(dim=_FIELD_DIMS)
    count = mask.to(squared.dtype).sum(dim=_FIELD_DIMS)
    return (total / count).sqrt()


def ensemble_spread(ensemble: torch.Tensor) -> torch.Tensor:
    """Ensemble spread per channel: sqrt of the mean over (N, H, W) of the unbiased member variance.

    This is the spread that goes with the ensemble-mean RMSE in a spread-skill ratio (for a
    reliable ensemble, RMSE of the mean ~= sqrt((E + 1) / E) * spread). Needs E >= 2.
    """
    _check_field("ensemble", ensemble, 5, "(E, N, C, H, W)")
    members = ensemble.shape[0]
    if members < 2:
        raise ValueError(f"ensemble spread needs at least 2 members on dim 0, got {members}")
    return ensemble.var(dim=0, correction=1).mean(dim=_FIELD_DIMS).sqrt()


def crps_ensemble(ensemble: torch.Tensor, truth: torch.Tensor, *, fair: bool = False) -> torch.Tensor:
    """Continuous ranked probability score per channel, averaged over (N, H, W).

    Pointwise, with members x_1..x_E and observation y:

    - plain (``fair=False``, default): the CRPS of the empirical ensemble distribution,
      ``mean_i |x_i - y| - 1/(2 E^2) sum_ij |x_i - x_j|``. A 1-member ensemble scores its MAE.
    - fair (``fair=True``): divides the spread term by ``2 E (E - 1)`` instead, the unbiased
      estimate of the CRPS of the distribution the members are drawn from (Ferro 2014); it does
      not reward small ensembles for being under-dispersed. Needs E >= 2.

    The pair sum is computed in O(E log E) from the sorted members:
    ``sum_ij |x_i - x_j| = 2 sum_i (2 i - E + 1) x_(i)`` with 0-based ranks i.
    """
    _check_field("ensemble", ensemble, 5, "(E, N, C, H, W)")
    if truth.shape != ensemble.shape[1:]:
        raise ValueError(
            f"truth has shape {tuple(truth.shape)} but one ensemble member has {tuple(ensemble.shape[1:])}; "
            "they must match element for element"
        )
    members = ensemble.shape[0]
    if fair and members < 2:
        raise ValueError("the fair CRPS needs at least 2 members on dim 0; use fair=False for 1 member")
    skill = (ensemble - truth).abs().mean(dim=0)
    ranks = torch.arange(members, dtype=ensemble.dtype, device=ensemble.device)
    weights = (2 * ranks - members + 1).reshape(members, 1, 1, 1, 1)
    pair_sum = 2 * (torch.sort(ensemble, dim=0).values * weights).sum(dim=0)
    pairs = members * (members - 1) if fair else members * members
    return (skill - pair_sum / (2 * pairs)).mean(dim=_FIELD_DIMS)
