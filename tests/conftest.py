"""Fixtures shared by test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from physics_dp.testing.rank_pool import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def fused_cpu_kernels_built() -> None:
    """Build the fused CPU norm kernels once, here, before rank processes need them (a first build
    takes some 10-20 s, which a rank would otherwise spend inside a timed task)."""
    from physics_dp.ops import fused_cpu

    fused_cpu.build()


@pytest.fixture(scope="module")
def fresh_rank_processes():
    """Fresh rank processes for a module: after earlier tests tore down and re-created the process
    group in the reused workers, Dynamo's fake run of a traced op met a group no longer registered
    (seen once in CI after tests/distributed ... tests/inference; cause not found yet). Compiled
    code in a fresh job is unaffected."""
    shutdown_pools()
    yield


@pytest.fixture(scope="module")
def one_gpu_mesh() -> Iterator:
    """A 1-rank ("domain",) mesh in this process, on its GPU (for the CUDA tests; see
    ``sharded_code_on_size_one_axes`` for running the sharded code there)."""
    from physics_dp.distributed import DistributedManager

    DistributedManager.initialize()  # a lone process: a 1-rank NCCL group
    try:
        yield DistributedManager().initialize_mesh((1,), ("domain",))
    finally:
        DistributedManager().cleanup()


@pytest.fixture
def full_fp32() -> Iterator[None]:
    """TF32 off on CUDA for the test: it rounds each product to 10 bits, differently for a slab and
    for a whole grid, so sharded and plain results could not be compared at fp32 tolerances."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
