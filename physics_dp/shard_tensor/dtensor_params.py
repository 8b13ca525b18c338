"""Parameters that are PyTorch DTensors (``torch.distributed.tensor.distribute_module``).

Code written for DTensor (or FSDP on a domain mesh) holds its parameters as ``Replicate``
DTensors.  Sharded ops compute on plain slabs, so such a parameter enters as its local replica
through DTensor's own differentiable ``to_local``: the gradient the op hands back (already
summed over the axes that split the data) becomes the parameter's ``.grad`` as a ``Replicate``
DTensor, the parameter's own type and placement.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["is_dtensor_param", "local_replica"]


def is_dtensor_param(param: object) -> bool:
    return isinstance(param, DTensor)


def local_replica(param: DTensor) -> torch.Tensor:
    """This rank's copy of a replicated DTensor parameter, differentiably."""
    if any(not isinstance(p, Replicate) for p in param.placements):
        raise ValueError(
            f"a DTensor parameter of shape {tuple(param.shape)} with placements {list(param.placements)} "
            "met a ShardTensor: only Replicate DTensor parameters (torch's distribute_module default) are "
            "supported; redistribute the parameter to Replicate, or shard it with FSDP, which gathers it"
        )
    return param.to_local(grad_placements=[Replicate()] * param.device_mesh.ndim)
