"""Run the sharded code of every op on mesh axes of size 1: how one GPU checks the multi-rank paths.

A ShardTensor whose sharded axes all have size 1 normally runs the plain op on its slab (no
collectives; `local_only` in the spec).  One GPU hosts one process, so on a lone GPU the halo,
statistics, pencil and ring code would never meet CUDA's kernels and rules (collectives over one
rank return their input; NCCL between ranks needs two GPUs).
Inside :func:`sharded_code_on_size_one_axes` they do, and the results must still equal the plain op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..shard_tensor import Replicate, ShardTensorSpec

__all__ = ["sharded_code_on_size_one_axes"]


@contextlib.contextmanager
def sharded_code_on_size_one_axes() -> Iterator[None]:
    """Within the block, specs made for a Shard placement on a size-1 axis take the sharded path
    (specs made before it keep theirs).  For tests and benchmarks, never for training: the
    shortcut it disables is what makes a 1-rank axis cost nothing."""
    derive = ShardTensorSpec._derive

    def derive_sharded(spec: ShardTensorSpec) -> None:
        derive(spec)
        spec.local_only = all(type(p) is Replicate for p in spec.placements)

    ShardTensorSpec._derive = derive_sharded  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardTensorSpec._derive = derive  # type: ignore[method-assign]
