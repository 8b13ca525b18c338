"""Run a network on grids it cannot take as they are (e.g. 73 rows into a U-Net that halves twice).

A U-Net needs H and W divisible by 2**(levels - 1), a DiT by its patch size; real grids rarely
are.  :class:`PadToMultiple` pads every field argument at the bottom/right edge by edge
replication and crops the output back, so the network sees a grid it accepts and the caller
never notices.  Plain PyTorch: pad and slice run sharded like any other op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PadToMultiple"]


class PadToMultiple(nn.Module):
    """``forward(x, *args, **kwargs)``: ``net`` on ``x`` and every other (N, C, H, W) argument padded
    to multiples of ``multiple``, output cropped to x's (H, W)."""

    def __init__(self, net: nn.Module, multiple: int):
        super().__init__()
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        self.net = net
        self.multiple = int(multiple)

    def _padding(self, height: int, width: int) -> tuple[int, int]:
        return -height % self.multiple, -width % self.multiple

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        height, width = x.shape[-2], x.shape[-1]
        pad_h, pad_w = self._padding(height, width)
        if not pad_h and not pad_w:
            return self.net(x, *args, **kwargs)

        def pad(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.ndim == 4 and tuple(value.shape[-2:]) == (height, width):
                return F.pad(value, (0, pad_w, 0, pad_h), mode="replicate")
            return value

        out = self.net(pad(x), *(pad(a) for a in args), **{k: pad(v) for k, v in kwargs.items()})
        return out[..., :height, :width]

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of parameter elements (only those with ``requires_grad`` if ``trainable_only``)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def padded_shape(self, height: int, width: int) -> tuple[int, int]:
        """The (H, W) the wrapped network sees for an (H, W) input."""
        pad_h, pad_w = self._padding(height, width)
        return height + pad_h, width + pad_w
