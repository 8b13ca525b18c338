"""``training.compile``: the model compiled in place, so checkpoints and exports keep their keys.

``nn.Module.compile`` compiles the module's call without wrapping it in another module: the
state dict, the optimizer's parameter list and FSDP's units stay exactly those of eager runs,
so a run may switch compile on or off and resume from the same checkpoints.  Under FSDP2 each
unit's forward is compiled instead of the whole model (see docs/architecture.md).  ShardTensor ops
trace into the graph (see docs/architecture.md, "torch.compile"); shapes are static, since
every rank's slab shape is fixed by the split.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["COMPILE_BACKENDS", "INDUCTOR_OPTIONS", "compile_in_place"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

# A traced backward cannot defer the parameter-gradient sums to the end of the pass (no end-of-pass
# callback runs inside a compiled graph: ``ops.grad_sums``), so it sums each parameter use with its
# own all-reduce.  Inductor's pass buckets the independent all-reduces of a graph: the lite U-Net's
# compiled step issued 161 per step, now 73.
INDUCTOR_OPTIONS = {"bucket_all_reduces_fx": "all"}


def compile_in_place(module: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile ``module``'s forward (and so its backward) with ``backend``; returns the module."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"unknown compile backend {backend!r}; expected one of {COMPILE_BACKENDS}")
    options = {"options": INDUCTOR_OPTIONS} if backend == "inductor" else {}
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        module.compile(backend=backend, dynamic=False, **options)
        return module
    # FSDP2's hooks live in each unit's __call__ and Dynamo does not trace them: compile what runs
    # between them, each unit's own forward, and leave the hooks and the glue around units eager.
    # Units of one class share their forward's code, and Dynamo caches graphs per code object: each
    # unit needs its own entries (its shapes, with and without grad), beyond the default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(units))
    for unit in units:
        unit.forward = torch.compile(unit.forward, backend=backend, dynamic=False, **options)
    return module
