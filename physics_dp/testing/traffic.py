"""What a sharded call sends, forward and backward, as tests count it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..distributed.collectives import count_communication

__all__ = ["forward_backward_traffic"]


def forward_backward_traffic(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[list, list]:
    """This rank's (kind, bytes sent) records for ``fn(x)`` and for its backward (ones cotangent)."""
    with count_communication() as forward:
        y = fn(x)
    with count_communication() as backward:
        y.backward(torch.ones_like(y))
    return [(r.kind, r.bytes_sent) for r in forward.records], [(r.kind, r.bytes_sent) for r in backward.records]
