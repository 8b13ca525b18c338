"""``training.compile``: the model compiled in place, so checkpoints and exports keep their keys.

``nn.Module.compile`` compiles the module's call without wrapping it in another module: the
state dict, the optimizer's parameter list and FSDP's units stay exactly those of eager runs,
so a run may switch compile on or off and resume from the same checkpoints.  ShardTensor ops
trace into the graph (see docs/architecture.md, "torch.compile"); shapes are static, since
every rank's slab shape is fixed by the split.
"""

from __future__ import annotations

from torch import nn

__all__ = ["COMPILE_BACKENDS", "compile_in_place"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def compile_in_place(module: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile ``module``'s forward (and so its backward) with ``backend``; returns the module."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"unknown compile backend {backend!r}; expected one of {COMPILE_BACKENDS}")
    module.compile(backend=backend, dynamic=False)
    return module
