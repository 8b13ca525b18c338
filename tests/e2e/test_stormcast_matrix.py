"""End-to-end recipes on CPU, in the spirit of PhysicsNeMo's StormCast training tests: every
architecture x layout x precision trains both StormCast stages through the real entry point code
(in the rank pool), the regression -> diffusion chain hands over the exported model, masked and
channel-weighted losses run, and the noise follows the (seed, step, sample) pattern."""

from __future__ import annotations

import math

import pytest
import torch

from physics_dp.config import compose_config
from physics_dp.testing import get_mesh, run_on_ranks

# Tiny synthetic grid and short runs: the matrix is about coverage, not learning.
TINY = [
    "data.synthetic.n_times=10",
    "data.synthetic.height=16",
    "data.synthetic.width=24",
    "data.train_times=[0,7]",
    "data.valid_times=[7,10]",
    "training.max_steps=2",
    "training.global_batch_size=2",
    "training.checkpoint_interval=2",
    "training.validation_interval=2",
    "training.validation_batches=1",
    "sampling.num_steps=2",
    "logging.wandb_mode=disabled",
]
# world size, data size, domain size
LAYOUTS = {"1": (1, 1, 1), "domain2": (2, 1, 2), "data2": (2, 2, 1), "2x2": (4, 2, 2)}


def _run(overrides: list[str]) -> dict:
    from physics_dp.training.run import train

    results = train(compose_config(overrides))
    results.pop("windows_read")
    return {stage: {"losses": r.losses, "validation": r.validation, "steps": r.steps} for stage, r in results.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("architecture", ["unet", "dit"])
def test_stormcast_trains_both_stages(tmp_path, architecture, layout, precision):
    world, data, domain = LAYOUTS[layout]
    overrides = [
        "+experiment=stormcast",
        *TINY,
        f"model.diffusion.architecture={architecture}",
        f"parallel.domain_size={domain}",
        f"training.precision={precision}",
        f"data.root={tmp_path}/data",
        f"run.dir={tmp_path}/run",
        "logging.figures=false",
    ]
    results = run_on_ranks(world, _run, overrides, timeout=300.0)
    for rank, result in enumerate(results):
        assert set(result) == {"regression", "diffusion"}
        for stage, summary in result.items():
            assert summary["steps"] == 2 and len(summary["losses"]) == 2, (rank, stage)
            assert all(math.isfinite(v) for v in summary["losses"]), (rank, stage, summary["losses"])
            assert summary["validation"] and all(math.isfinite(v) for v in summary["validation"].values())
        assert result == results[0]  # every rank reports the same (replica-averaged) numbers
    for stage in ("regression", "diffusion"):
        assert (tmp_path / "run" / stage / "model.pt").is_file()
        assert (tmp_path / "run" / stage / "checkpoints" / "step_000002").is_dir()


def test_regression_to_diffusion_chain_uses_exported_model(tmp_path):
    """stage=diffusion alone picks up a previous run's exported regression model; without one it
    says what to do."""
    base = ["+experiment=stormcast", *TINY, f"data.root={tmp_path}/data", "logging.figures=false"]
    run_on_ranks(2, _run, base + ["training.stage=regression", f"run.dir={tmp_path}/first", "parallel.domain_size=2"], timeout=300.0)
    weights = tmp_path / "first" / "regression" / "model.pt"
    chained = run_on_ranks(
        2, _run, base + ["training.stage=diffusion", f"run.dir={tmp_path}/second", f"training.regression_weights={weights}", "parallel.domain_size=2"],
        timeout=300.0,
    )
    assert set(chained[0]) == {"diffusion"} and len(chained[0]["diffusion"]["losses"]) == 2
    missing = run_on_ranks(1, _error, base + ["training.stage=diffusion", f"run.dir={tmp_path}/third"], timeout=300.0)
    assert "needs the trained regression model" in missing[0]


def _error(overrides: list[str]) -> str:
    try:
        _run(overrides)
    except Exception as error:
        return str(error)
    return "no error"


def test_masked_channel_weighted_loss(tmp_path):
    """The synthetic t2m has missing points (a mask); channel weights scale the loss per channel."""
    base = ["+experiment=stormcast", *TINY, f"data.root={tmp_path}/data", "logging.figures=false", "parallel.domain_size=2"]
    plain = run_on_ranks(2, _run, base + [f"run.dir={tmp_path}/a"], timeout=300.0)[0]
    weighted = run_on_ranks(2, _run, base + [f"run.dir={tmp_path}/b", "training.channel_weights=[1.0,1.0,0.0]"], timeout=300.0)[0]
    for stage in ("regression", "diffusion"):
        assert all(math.isfinite(v) for v in weighted[stage]["losses"])
        assert weighted[stage]["losses"][0] < plain[stage]["losses"][0]  # a channel's error no longer counts
    wrong = run_on_ranks(1, _error, base[:-1] + [f"run.dir={tmp_path}/c", "training.channel_weights=[1.0,2.0]"], timeout=300.0)
    assert "channel_weights must have shape (3,)" in wrong[0]


def _noise_pattern() -> dict:
    """The noise each rank of a 2 (data) x 2 (domain) job draws at one training step."""
    from physics_dp.diffusion import derive_seed, randn_like_global
    from physics_dp.nn import domain_mesh
    from physics_dp.shard_tensor import Shard, distribute_tensor
    from physics_dp.training.trainer import replica_sample_ids

    mesh = get_mesh((2, 2), ("data", "domain"))
    data_rank = mesh.get_local_rank("data")
    ids = replica_sample_ids({"epoch": 1, "step": 3}, steps_per_epoch=5, batch_size=2, data_rank=data_rank, data_size=2)
    like = distribute_tensor(torch.zeros(2, 3, 11, 8), domain_mesh(mesh), [Shard(2)])
    seed = derive_seed(0, 7, 0)
    noise = randn_like_global(like, seed, ids).full_tensor()
    single = randn_like_global(torch.zeros(2, 3, 11, 8), seed, ids)
    return {"ids": ids.tolist(), "noise": noise, "equal_single_device": torch.equal(noise, single)}


def test_noise_is_shared_over_domain_and_differs_over_data():
    results = run_on_ranks(4, _noise_pattern)
    # mesh rank = data * 2 + domain
    assert results[0]["ids"] == results[1]["ids"] == [32, 33] and results[2]["ids"] == results[3]["ids"] == [34, 35]
    assert all(r["equal_single_device"] for r in results)
    assert torch.equal(results[0]["noise"], results[1]["noise"]) and torch.equal(results[2]["noise"], results[3]["noise"])
    assert not torch.allclose(results[0]["noise"], results[2]["noise"])
    # A 1-replica job draws the same four samples at this step.
    from physics_dp.training.trainer import replica_sample_ids

    assert replica_sample_ids({"epoch": 1, "step": 3}, 5, 4, 0, 1).tolist() == [32, 33, 34, 35]


def _run_counting_graphs(overrides: list[str]) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    summary = _run(overrides)
    summary["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return summary


@pytest.mark.parametrize("data_parallel", ["fsdp", "none"])
def test_compiled_training_equals_eager(tmp_path, data_parallel):
    """training.compile=true trains both stages on 2 domain ranks with eager's losses (to 1e-4)."""
    overrides = [
        "+experiment=stormcast",
        *TINY,
        "training.max_steps=3",
        "parallel.domain_size=2",
        f"parallel.data_parallel={data_parallel}",
        "logging.figures=false",
        f"data.root={tmp_path}/data",
    ]
    eager = run_on_ranks(2, _run_counting_graphs, [*overrides, f"run.dir={tmp_path}/eager"], timeout=300.0)
    compiled = run_on_ranks(
        2,
        _run_counting_graphs,
        [*overrides, f"run.dir={tmp_path}/compiled", "training.compile=true", "training.compile_backend=aot_eager"],
        timeout=300.0,
    )
    for eager_rank, compiled_rank in zip(eager, compiled):
        assert eager_rank["graphs"] == 0 and compiled_rank["graphs"] >= 2, compiled_rank["graphs"]  # both stages' models
        if data_parallel == "none":  # whole graphs: per stage one for training and one for no-grad evaluation
            assert compiled_rank["graphs"] == 4, compiled_rank["graphs"]
        for stage in ("regression", "diffusion"):
            torch.testing.assert_close(
                compiled_rank[stage]["losses"], eager_rank[stage]["losses"], atol=1e-4, rtol=1e-4, msg=stage
            )
