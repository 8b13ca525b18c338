"""Which fields a recipe's networks see, as channel counts and stacked tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Channels", "stack_condition"]


@dataclass(frozen=True)
class Channels:
    state: int
    background: int
    invariants: int

    @classmethod
    def from_names(cls, names: dict[str, list[str]]) -> Channels:
        return cls(len(names.get("state", [])), len(names.get("background", [])), len(names.get("invariants", [])))

    @property
    def forcing(self) -> int:
        """Background plus invariant channels."""
        return self.background + self.invariants


def stack_condition(batch: dict[str, torch.Tensor], *keys: str) -> torch.Tensor | None:
    """The named batch fields that exist, concatenated along channels (None when there are none)."""
    fields = [batch[key] for key in keys if key in batch]
    if not fields:
        return None
    return fields[0] if len(fields) == 1 else torch.cat(fields, dim=1)
