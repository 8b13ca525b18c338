"""Loss functions whose reduction spans a sharded grid: per-element loss, then a sharded sum or mean.

torch's fused loss kernels (``mse_loss``, ``huber_loss``, ``binary_cross_entropy``, ...) reduce
inside the op, and DTensor's rule for them averages per shard, which is wrong on uneven or empty
shards (they raised).  Here those losses run with ``reduction="none"`` on torch's own path (so
torch checks the arguments) and the result is reduced by physics_dp's ``sum`` / ``mean``, which
weigh every element once.  Losses torch already writes as elementwise ops plus ``sum`` / ``mean``
(``l1_loss``, weighted ``mse_loss``, ``kl_div``, ``poisson_nll_loss``, ``gaussian_nll_loss``,
``hinge_embedding_loss``, ``margin_ranking_loss``) need nothing and are not intercepted.

``nll_loss`` / ``cross_entropy`` take the log-probabilities of every class at each point, so with
the class dim (1) whole on each rank the per-point loss is local: torch's op runs on the slabs
with ``reduction="none"`` and the target laid out like the input without dim 1 (moved there if it
is split otherwise; a plain target is sliced).  Their ``mean`` over class indices is torch's
weighted mean: the summed loss over the summed ``weight[target]`` of the points not ignored, with
label smoothing too.  Probability targets (the input's shape) average over the points.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import _reduction

from ..shard_tensor import Shard, ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import from_local_with_spec, redistribute_to_spec, replicate_plain, to_local
from ..shard_tensor.dispatch import run_default
from ..shard_tensor.redistribute import without_partials
from ._local import ShardedOpError, local_param

__all__: list[str] = []

# torch reduces these inside one kernel; each takes ``reduction`` and is elementwise before it
_FUSED_ELEMENTWISE = (
    F.mse_loss,
    F.huber_loss,
    F.smooth_l1_loss,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.soft_margin_loss,
)
_CLASS_LOSSES = (F.nll_loss, F.cross_entropy)
_SIGNATURES = {func: inspect.signature(func) for func in (*_FUSED_ELEMENTWISE, *_CLASS_LOSSES)}


def _bind(func: Any, args: tuple, kwargs: dict) -> tuple[inspect.BoundArguments, str]:
    """The call's arguments and the reduction it asks for; deprecated ``size_average`` / ``reduce``
    flags are translated as torch does (with its warning) and cleared from the arguments."""
    call = _SIGNATURES[func].bind(*args, **kwargs)
    given = call.arguments
    size_average, reduce = given.get("size_average"), given.get("reduce")
    if size_average is None and reduce is None:
        return call, given.get("reduction", "mean")
    given["size_average"] = given["reduce"] = None
    return call, _reduction.legacy_get_string(size_average, reduce)


def _reduce_elementwise(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """The loss with ``reduction="none"`` through torch's path, then a sharded mean or sum."""
    call, reduction = _bind(func, args, kwargs)
    # a weighted mse_loss is torch's own sum(w * loss) / sum(w) of sharded ops: it needs nothing
    weighted_mse = func is F.mse_loss and call.arguments.get("weight") is not None
    if reduction not in ("mean", "sum") or weighted_mse:
        return run_default(func, args, kwargs)
    call.arguments["reduction"] = "none"
    loss = run_default(func, call.args, call.kwargs)
    return loss.mean() if reduction == "mean" else loss.sum()


def _without_class_dim(spec: ShardTensorSpec) -> ShardTensorSpec:
    """The contiguous layout of the per-point loss (and of class-index targets) of an input of ``spec``."""
    placements = [Shard(p.dim - 1) if type(p) is Shard and p.dim > 1 else p for p in spec.placements]
    return ShardTensorSpec(spec.mesh, placements, spec.shape[:1] + spec.shape[2:], spec.axis_sizes)


def _slab(tensor: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    """This rank's slab of ``tensor`` split as ``spec``, differentiably (a plain tensor is whole on
    every rank: sliced, nothing sent)."""
    if not isinstance(tensor, ShardTensor):
        tensor = replicate_plain(tensor, spec.mesh)
    return to_local(redistribute_to_spec(tensor, spec))


def _class_loss(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """``nll_loss`` / ``cross_entropy`` on the slabs, reduced over the grid."""
    call, reduction = _bind(func, args, kwargs)
    given = call.arguments
    x, target = given["input"], given["target"]
    if reduction not in ("none", "mean", "sum") or not isinstance(x, ShardTensor) or x.ndim < 2:
        return run_default(func, args, kwargs)
    name = func.__name__
    if any(type(p) is Shard and p.dim == 1 for p in x.placements):
        raise ShardedOpError(
            name, [x], "the class dim 1 is sharded, but each point's loss needs all its classes on one rank: "
            "redistribute the input so that dim 1 is whole (shard a spatial or the batch dim instead)"
        )
    x = redistribute_to_spec(x, without_partials(x._spec))  # a log-softmax needs the reduced values
    loss_spec = _without_class_dim(x._spec)
    probabilities = target.shape == x.shape
    if not probabilities and target.shape != loss_spec.shape:
        raise ValueError(
            f"{name}: target of shape {tuple(target.shape)} fits input {tuple(x.shape)} neither as class indices "
            f"(shape {tuple(loss_spec.shape)}) nor as class probabilities (the input's shape)"
        )
    local_target = _slab(target, x._spec.replace() if probabilities else loss_spec)
    weight = local_param(given.get("weight"), x)
    options = {k: v for k, v in given.items() if k not in ("input", "target")}
    local = func(to_local(x), local_target, **{**options, "weight": weight, "reduction": "none"})
    loss = from_local_with_spec(local, loss_spec)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if probabilities:
        return loss.mean()
    # torch's mean over class indices: divided by the summed weight of the targets not ignored
    kept = local_target != given.get("ignore_index", -100)
    counts = kept.to(local.dtype) if weight is None else weight.detach()[local_target.masked_fill(~kept, 0)] * kept
    return loss.sum() / from_local_with_spec(counts, loss_spec).sum()


for _func in _FUSED_ELEMENTWISE:
    ShardTensor.register_function_handler(_func, _reduce_elementwise)
for _func in _CLASS_LOSSES:
    ShardTensor.register_function_handler(_func, _class_loss)
