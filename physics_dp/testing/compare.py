"""``assert_sharded_matches``: the sharded call must equal the single-device call, with gradients.

Users run it on their own modules to check that every op their model uses is supported
exactly; physics_dp's own op tests are built on it.  Call it on every rank with the same
global inputs (same seed): each rank computes the single-device reference itself, so the
comparison needs no communication beyond the sharded computation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..shard_tensor import Placement, ShardTensor, distribute_tensor

__all__ = ["assert_sharded_matches", "MatchReport"]


@dataclass
class MatchReport:
    """Largest absolute differences found, by name (outputs, input grads, parameter grads)."""

    max_abs_diff: dict[str, float] = field(default_factory=dict)
    output_placements: list[tuple[Placement, ...]] = field(default_factory=list)


def _full(value: Any) -> Any:
    if isinstance(value, ShardTensor):
        return value.full_tensor()
    if hasattr(value, "full_tensor"):  # DTensor
        return value.full_tensor()
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _dot(output: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    product = output * cotangent.conj()
    return (product.real if product.is_complex() else product).sum()


def _compare(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, report: MatchReport) -> None:
    actual = _full(actual).detach()
    expected = expected.detach()
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != single-device {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != single-device {expected.dtype}")
    if actual.is_complex():  # real and imaginary parts each must match (.double() would drop the imaginary part)
        actual, expected = torch.view_as_real(actual.resolve_conj()), torch.view_as_real(expected.resolve_conj())
    diff = (actual.double() - expected.double()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    report.max_abs_diff[name] = worst
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol, equal_nan=True):
        raise AssertionError(f"{name}: sharded differs from single device by up to {worst:.3e} (atol={atol}, rtol={rtol})")


def assert_sharded_matches(
    fn_or_module: Callable[..., Any] | torch.nn.Module,
    inputs: Sequence[Any],
    mesh: DeviceMesh,
    placements: Sequence[Sequence[Placement] | None],
    *,
    sharding_sizes: Sequence[dict[int, Sequence[int]] | None] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    check_grads: bool = True,
    seed: int = 1234,
) -> MatchReport:
    """Run ``fn_or_module`` sharded and on one device; compare outputs, input and parameter grads.

    ``inputs`` are global values, identical on every rank, or ShardTensors the caller already
    built (e.g. with ``scatter_tensor``), which run as they are while the single-device run gets
    their ``full_tensor()``.  ``placements[i]`` shards global tensor input ``i`` (``None`` passes
    it as it is); ``sharding_sizes[i]`` optionally sets its split per mesh axis (default:
    balanced).  Backward uses a random cotangent (``seed``), fed to the sharded output in its own
    layout.  Complex tensors are compared on their real and imaginary parts, and take gradients.
    """
    if len(placements) != len(inputs):
        raise ValueError(f"got {len(placements)} placements for {len(inputs)} inputs")
    sizes = list(sharding_sizes) if sharding_sizes is not None else [None] * len(inputs)
    is_module = isinstance(fn_or_module, torch.nn.Module)
    reference_fn = copy.deepcopy(fn_or_module) if is_module else fn_or_module

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and check_grads and _differentiable(value):
            return value.detach().clone().requires_grad_(True)
        return value

    ref_inputs = [leaf(_full(v)) for v in inputs]
    shard_inputs = []
    for value, placement, split in zip(inputs, placements, sizes):
        if isinstance(value, ShardTensor) and placement is not None:
            raise ValueError("an input that is already a ShardTensor takes placement None")
        if placement is None or not isinstance(value, torch.Tensor):
            shard_inputs.append(leaf(value))
            continue
        sharded = distribute_tensor(value.detach(), mesh, placement, split)
        if check_grads and _differentiable(value):
            sharded.requires_grad_(True)
        shard_inputs.append(sharded)

    report = MatchReport()
    ref_out = reference_fn(*ref_inputs)
    shard_out = fn_or_module(*shard_inputs)
    ref_list, shard_list = _tensors(ref_out), _tensors(shard_out)
    if len(ref_list) != len(shard_list):
        raise AssertionError(f"sharded call returned {len(shard_list)} tensors, single device {len(ref_list)}")
    for i, (actual, expected) in enumerate(zip(shard_list, ref_list)):
        if isinstance(actual, ShardTensor):
            report.output_placements.append(actual.placements)
        _compare(f"output[{i}]", actual, expected, atol, rtol, report)
    if not check_grads:
        return report

    generator = torch.Generator().manual_seed(seed)
    ref_terms = []
    for actual, expected in zip(shard_list, ref_list):
        if not expected.requires_grad or not _differentiable(expected):
            continue
        cotangent = torch.randn(expected.shape, generator=generator, dtype=expected.dtype).to(expected.device)
        # Re<cotangent, output>: the real loss whose gradient w.r.t. the output is ``cotangent``
        # (torch's convention for complex tensors; the plain dot product for real ones)
        ref_terms.append(_dot(expected, cotangent))
        if isinstance(actual, ShardTensor) and not actual._spec.has_partial:
            shard_cotangent = distribute_tensor(cotangent, mesh, actual.placements, _split_of(actual))
            actual.backward(shard_cotangent, retain_graph=True)
        else:
            _dot(_full(actual), cotangent).backward(retain_graph=True)
    if ref_terms:
        torch.stack(ref_terms).sum().backward()

    for i, (actual, expected) in enumerate(zip(shard_inputs, ref_inputs)):
        if isinstance(expected, torch.Tensor) and expected.requires_grad:
            if expected.grad is None:
                continue
            if actual.grad is None:
                raise AssertionError(f"input[{i}]: no gradient on the sharded side")
            _compare(f"input[{i}].grad", actual.grad, expected.grad, atol, rtol, report)
    if is_module:
        ref_params = dict(reference_fn.named_parameters())
        for name, param in fn_or_module.named_parameters():
            expected = ref_params[name].grad
            if expected is None:
                continue
            if param.grad is None:
                raise AssertionError(f"parameter {name}: no gradient on the sharded side")
            _compare(f"{name}.grad", param.grad, expected, atol, rtol, report)
    return report


def _split_of(tensor: ShardTensor) -> dict[int, Sequence[int]]:
    return {axis: sizes for axis, sizes in enumerate(tensor._spec.axis_sizes) if sizes is not None}
