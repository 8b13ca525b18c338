"""parallelize on one GPU (skipped without one; CI has none): FSDP2, DDP and no data parallelism
over a ("data", "domain") = (1, 1) mesh, every op's sharded code on (``sharded_code_on_size_one_axes``),
one training step against the model on the same GPU; bf16 compute against fp32."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from physics_dp.distributed import DistributedManager
from physics_dp.testing import sharded_code_on_size_one_axes

from .test_parallelize import bf16_gradients_against_fp32, step_against_one_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def data_domain_mesh(one_gpu_mesh) -> Iterator:
    yield DistributedManager().initialize_mesh((1, 1), ("data", "domain"))


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp", "none"])
@pytest.mark.parametrize("kind", ["regression", "diffusion_unet", "diffusion_dit"])
def test_training_step_on_one_gpu_matches_the_plain_model(kind, data_parallel, data_domain_mesh, full_fp32):
    with sharded_code_on_size_one_axes():
        worst = step_against_one_device(kind, data_domain_mesh, data_parallel)
    assert worst["output_type"] == "ShardTensor"
    for key in ("output", "input_grad", "param_grad", "param_after_step"):
        assert worst[key] < 1e-4, f"{key} differs by {worst[key]:.3e}"
    assert worst["loss_replica"] == pytest.approx(worst["ref_loss"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("data_parallel", ["fsdp", "none"])
def test_bf16_compute_fp32_gradients_on_one_gpu(data_parallel, data_domain_mesh):
    with sharded_code_on_size_one_axes():
        assert bf16_gradients_against_fp32(data_domain_mesh, data_parallel) < 0.1
