"""Let FSDP2 (``fully_shard`` over the "data" mesh axis) wrap a domain-parallel module.

FSDP2 hooks a module's outputs to schedule its backward (re-gathering parameters, reducing
gradients).  Those hooks are written for plain tensors, so :class:`FSDPOutputTensorAdapter` hands
them the rank's local slab of every ``ShardTensor`` output and remembers each output's layout;
:meth:`FSDPOutputTensorAdapter.restore` (outside FSDP) rewraps the slabs, so the loss is computed
on ShardTensors and is the true global mean over the whole domain, uneven shards weighted by
their size, rather than a mean of per-rank means.

Parameters stay plain tensors replicated over the domain axes: physics_dp's ops sum their
gradient shares over the domain axes inside backward, once, and FSDP (or DDP) then averages over
the data axis only, so nothing is counted twice.

Inputs that need no communication (every ShardTensor input on a one-rank domain, as with
``domain_size=1``, or replicated) cost nothing: each slab is the whole global value, so the module
runs on the plain slabs, with no ShardTensor dispatch inside it, and its outputs are rewrapped
as the per-op local-only path lays them out (``shard_tensor/local_only.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..ops.grad_sums import immediate_parameter_sums
from ..shard_tensor import ShardTensor, ShardTensorSpec
from ..shard_tensor.conversions import from_local_with_spec, to_local
from ..shard_tensor.local_only import local_only_spec, output_placements
from .module_sync import PartitionFn, distribute_module

__all__ = ["FSDPOutputTensorAdapter", "wrap_for_fsdp", "distribute_over_domain_for_fsdp"]

# The slabs handed to FSDP are views of tensors nobody else holds, and they are only ever rewrapped
# by ``restore``: FSDP's warning about in-place ops on returned views does not apply to them.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPFSDPOutputTensorAdapter\) returned a view")


class FSDPOutputTensorAdapter(nn.Module):
    """``forward`` returns the wrapped module's outputs with ShardTensors replaced by their slabs.

    Apply ``fully_shard`` to this adapter (and, if wanted, to blocks inside ``module``); call
    :meth:`restore` on what the FSDP-wrapped adapter returned to get ShardTensors back.  The
    layouts are kept from the latest forward, so call ``restore`` before the next forward.
    """

    def __init__(self, module: nn.Module, immediate_grad_sums: bool = True):
        super().__init__()
        self.module = module
        # FSDP's and DDP's backward hooks read parameter gradients before backward ends, so the
        # domain sums of those gradients must not wait for the end-of-backward buckets
        self.immediate_grad_sums = immediate_grad_sums
        self._layouts: list[ShardTensorSpec | None] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        layout = local_only_spec(tuple(tree_flatten((args, kwargs))[0]), {})
        if layout is not None:
            return self._forward_on_slabs(layout, args, kwargs)
        with immediate_parameter_sums() if self.immediate_grad_sums else contextlib.nullcontext():
            outputs = self.module(*args, **kwargs)
        leaves, tree = tree_flatten(outputs)
        self._layouts = [leaf._spec if isinstance(leaf, ShardTensor) else None for leaf in leaves]
        plain = [to_local(leaf) if isinstance(leaf, ShardTensor) else leaf for leaf in leaves]
        return tree_unflatten(plain, tree)

    def _forward_on_slabs(self, layout: ShardTensorSpec, args: tuple, kwargs: dict) -> Any:
        """The module on the plain slabs of inputs that need no communication; every tensor output
        is then laid out like ``layout`` (see ``local_only.output_placements``)."""
        args, kwargs = tree_map(lambda leaf: to_local(leaf) if isinstance(leaf, ShardTensor) else leaf, (args, kwargs))
        outputs = self.module(*args, **kwargs)
        self._layouts = [
            ShardTensorSpec(layout.mesh, output_placements(layout, leaf.ndim), leaf.shape) if isinstance(leaf, torch.Tensor) else None
            for leaf in tree_flatten(outputs)[0]
        ]
        return outputs

    def restore(self, outputs: Any) -> Any:
        """Rewrap the local outputs of the latest forward as ShardTensors (differentiably)."""
        if self._layouts is None:
            raise RuntimeError("FSDPOutputTensorAdapter.restore called before any forward")
        leaves, tree = tree_flatten(outputs)
        if len(leaves) != len(self._layouts):
            raise RuntimeError(
                f"restore got {len(leaves)} outputs but the latest forward returned {len(self._layouts)}; "
                "pass exactly what the adapter returned"
            )
        rewrapped = [
            leaf if spec is None else from_local_with_spec(_check_slab(leaf, spec), spec)
            for leaf, spec in zip(leaves, self._layouts)
        ]
        return tree_unflatten(rewrapped, tree)


def _check_slab(local: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    if isinstance(local, ShardTensor) or tuple(local.shape) != tuple(spec.local_shape()):
        raise RuntimeError(
            f"restore expected a local slab of shape {tuple(spec.local_shape())}, got "
            f"{type(local).__name__} of shape {tuple(local.shape)}"
        )
    return local


def wrap_for_fsdp(module: nn.Module) -> FSDPOutputTensorAdapter:
    """``module`` behind the output adapter (idempotent); ``fully_shard`` the result."""
    return module if isinstance(module, FSDPOutputTensorAdapter) else FSDPOutputTensorAdapter(module)


def distribute_over_domain_for_fsdp(
    module: nn.Module, device_mesh: DeviceMesh, partition_fn: PartitionFn | None = None
) -> FSDPOutputTensorAdapter:
    """Make every replica of ``module`` identical over ``device_mesh`` (all its axes, data included,
    since FSDP shards from equal starting values), run ``partition_fn`` on its submodules, and
    wrap it for FSDP."""
    return wrap_for_fsdp(distribute_module(module, device_mesh, partition_fn))
