"""The code paths a multi-GPU job takes, run where tests run: on CPU ranks, or on one GPU.

- A ShardTensor whose sharded axes all have size 1 normally runs the plain op on its slab (no
  collectives; `local_only` in the spec). One GPU hosts one process, so on a lone GPU the halo,
  statistics, pencil and ring code would never meet CUDA's kernels and rules. Inside
  :func:`sharded_code_on_size_one_axes` they do (collectives over one rank return their input;
  NCCL between ranks needs two GPUs), and the results must still equal the plain op.
- CPU ranks on one host exchange through shared memory (`distributed/host_channel.py`); CUDA
  tensors never do, so a GPU job's every exchange goes through torch's collectives (c10d).
  :func:`collectives_over_c10d` (from the channel's module) sends CPU ranks that way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..distributed.host_channel import collectives_over_c10d
from ..shard_tensor import ShardTensorSpec

__all__ = ["collectives_over_c10d", "sharded_code_on_size_one_axes"]


@contextlib.contextmanager
def sharded_code_on_size_one_axes() -> Iterator[None]:
    """Within the block, specs made for a Shard placement on a size-1 axis take the sharded path
    (specs made before it keep theirs).  For tests and benchmarks, never for training: the
    shortcut it disables is what makes a 1-rank axis cost nothing."""
    previous, ShardTensorSpec.size_one_shortcut = ShardTensorSpec.size_one_shortcut, False
    try:
        yield
    finally:
        ShardTensorSpec.size_one_shortcut = previous
