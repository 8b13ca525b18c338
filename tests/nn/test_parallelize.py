"""parallelize: data (FSDP2 / DDP) x domain meshes give one device's outputs, loss, gradients and
optimizer step, for every model at its ``test`` size."""

from __future__ import annotations

import copy
import functools
import math
import warnings
from importlib import resources

import pytest
import torch
import yaml
from torch import nn
from torch.distributed.tensor import DTensor

from physics_dp.models import EDMPrecond, build_backbone, build_regression_unet
from physics_dp.nn import FSDPOutputTensorAdapter, default_fsdp_units, domain_mesh, parallelize
from physics_dp.nn.parallelize import DEFAULT_FSDP_UNIT_PARAMS
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import collectives_over_c10d, get_mesh, run_on_ranks

GRID = (16, 12)
STATE, COND = 2, 3
GLOBAL_BATCH = 2

# (mesh shape, axis names): data x domain, plus a 2-D H x W domain decomposition.
LAYOUTS = {
    "1x1": ((1, 1), ("data", "domain")),
    "1x2": ((1, 2), ("data", "domain")),
    "1x3": ((1, 3), ("data", "domain")),
    "1x4": ((1, 4), ("data", "domain")),
    "2x2": ((2, 2), ("data", "domain")),
    "1x2x2_HxW": ((1, 2, 2), ("data", "domain_h", "domain_w")),
}


def _test_config() -> dict:
    text = resources.files("physics_dp.configs").joinpath("model/test.yaml").read_text()
    return yaml.safe_load(text)


def _build(kind: str) -> nn.Module:
    """The ``test``-size model; adaLN-Zero and other zero-initialized weights are randomized so that
    every gradient is non-trivial."""
    cfg = _test_config()
    torch.manual_seed(0)
    if kind == "regression":
        model = build_regression_unet(
            grid_shape=GRID, in_channels=STATE, out_channels=STATE, cond_channels=COND, options=cfg["regression"]
        )
    else:
        architecture = kind.removeprefix("diffusion_")
        net = build_backbone(
            architecture,
            grid_shape=GRID,
            in_channels=STATE,
            out_channels=STATE,
            cond_channels=COND,
            options=cfg["diffusion"][architecture],
        )
        model = EDMPrecond(net, sigma_data=cfg["diffusion"]["sigma_data"])
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.2)
    return model


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(GLOBAL_BATCH, STATE, *GRID, generator=gen),
        "condition": torch.randn(GLOBAL_BATCH, COND, *GRID, generator=gen),
        "target": torch.randn(GLOBAL_BATCH, STATE, *GRID, generator=gen),
        "sigma": torch.exp(torch.randn(GLOBAL_BATCH, generator=gen) * 1.2 - 1.2),
    }


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Adam's first step is sign(grad) * lr wherever |grad| << eps fails to hold; eps = 1e-4 keeps
    # that amplification of fp32 rounding (lr / eps = 10) small enough to compare at 1e-4.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.01)


def _call(kind: str, model: nn.Module, x, condition, sigma):
    return model(x, condition) if kind == "regression" else model(x, sigma, condition)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, (DTensor,)) or hasattr(t, "full_tensor") else t


def _equivalence(kind: str, layout: str, data_parallel: str) -> dict[str, float]:
    return step_against_one_device(kind, get_mesh(*LAYOUTS[layout]), data_parallel)


def _mesh_device(mesh) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def step_against_one_device(kind: str, mesh, data_parallel: str, unit_params: int = DEFAULT_FSDP_UNIT_PARAMS) -> dict[str, float]:
    """One training step of ``parallelize(model, mesh, data_parallel)`` (FSDP units of at least
    ``unit_params`` parameters) against the model on one device (on the mesh's device type): the
    largest differences, the losses and the output type."""
    device = _mesh_device(mesh)
    batch = {name: t.to(device) for name, t in _batch().items()}
    model = _build(kind).to(device)
    reference = copy.deepcopy(model)
    ref_optim = _optimizer(reference)

    ref_x = batch["x"].clone().requires_grad_(True)
    ref_out = _call(kind, reference, ref_x, batch["condition"], batch["sigma"])
    ref_loss = ((ref_out - batch["target"]) ** 2).mean()
    ref_loss.backward()
    ref_optim.step()

    parallel = parallelize(model, mesh, data_parallel, fsdp_units=functools.partial(default_fsdp_units, min_params=unit_params))
    optim = _optimizer(parallel.model)
    domain = domain_mesh(mesh)
    placements = [Shard(2)] if domain.ndim == 1 else [Shard(2), Shard(3)]
    replicas, replica = mesh.size(0), mesh.get_local_rank(0)
    rows = slice(replica * GLOBAL_BATCH // replicas, (replica + 1) * GLOBAL_BATCH // replicas)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(t[rows].contiguous(), domain, placements)

    x = shard(batch["x"]).requires_grad_(True)
    out = _call(kind, parallel, x, shard(batch["condition"]), batch["sigma"][rows])
    loss = ((out - shard(batch["target"])) ** 2).mean()  # the global mean over this replica's domain
    loss.backward()
    optim.step()

    worst = {
        "output": (out.full_tensor() - ref_out[rows]).abs().max().item(),
        # Each replica's loss is the mean over its samples; FSDP/DDP average the replicas.
        "loss_replica": loss.full_tensor().item(),
        # d(replica loss)/dx = replicas * d(global loss)/dx.
        "input_grad": (x.grad.full_tensor() / replicas - ref_x.grad[rows]).abs().max().item(),
        "param_grad": 0.0,
        "param_after_step": 0.0,
    }
    ref_params = dict(reference.named_parameters())
    for name, param in parallel.model.named_parameters():
        worst["param_grad"] = max(worst["param_grad"], (_full(param.grad) - ref_params[name].grad).abs().max().item())
        worst["param_after_step"] = max(worst["param_after_step"], (_full(param.detach()) - ref_params[name].detach()).abs().max().item())
    worst["ref_loss"] = ref_loss.item()
    worst["output_type"] = type(out).__name__
    return worst


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["regression", "diffusion_unet", "diffusion_dit"])
def test_matches_single_device(kind, layout, data_parallel):
    world = math.prod(LAYOUTS[layout][0])
    results = run_on_ranks(world, _equivalence, kind, layout, data_parallel, timeout=180.0)
    replicas = LAYOUTS[layout][0][0]
    for rank, worst in enumerate(results):
        assert worst["output_type"] == "ShardTensor"
        for key in ("output", "input_grad", "param_grad", "param_after_step"):
            assert worst[key] < 1e-4, f"rank {rank}: {key} differs by {worst[key]:.3e}"
    # The replicas' losses average to the single-device loss over the whole batch.
    per_replica = [results[r]["loss_replica"] for r in range(0, world, world // replicas)]
    assert sum(per_replica) / replicas == pytest.approx(results[0]["ref_loss"], rel=1e-5, abs=1e-6)


def _block_units_step(kind: str) -> dict[str, float]:
    return step_against_one_device(kind, get_mesh(*LAYOUTS["2x2"]), "fsdp", unit_params=0)


@pytest.mark.parametrize("kind", ["regression", "diffusion_unet", "diffusion_dit"])
def test_fsdp_with_every_block_a_unit_matches_single_device(kind):
    """The test models' blocks are far below the default unit size, so the cases above shard them
    with the root; here each block gathers and reduces on its own."""
    for rank, worst in enumerate(run_on_ranks(4, _block_units_step, kind, timeout=180.0)):
        for key in ("output", "input_grad", "param_grad", "param_after_step"):
            assert worst[key] < 1e-4, f"rank {rank}: {key} differs by {worst[key]:.3e}"


def _units_of(model: nn.Module, min_params: int) -> list[str]:
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(unit)] for unit in default_fsdp_units(model, min_params)]


def test_default_units_are_the_blocks_of_at_least_the_unit_size():
    model = nn.Sequential(
        nn.Linear(4, 4),  # 20 parameters
        nn.ModuleList([nn.Linear(8, 8), nn.Sequential(nn.Linear(2, 2), nn.Linear(3, 3)), nn.ReLU()]),  # 72, 6 + 12, none
    )
    assert _units_of(model, 0) == ["1.0", "1.1"]  # the root's own items are in the root's unit
    assert _units_of(model, 19) == ["1.0"]  # and the 18 parameters of 1.1 with them
    assert _units_of(model, 100) == []
    wrapped = nn.Sequential(model)
    assert _units_of(wrapped, 0) == ["0.0", "0.1"]  # outermost first: the list inside 0.1 goes with it
    assert _units_of(wrapped, 50) == ["0.1"]


def _accumulated_grads(data_parallel: str, sync_each: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Two micro-batches on a (2, 2) mesh, their data reductions after each backward or (as the
    trainer accumulates) only after the last: the summed gradients and FSDP's reduce-scatters."""
    import torch.distributed as dist

    mesh = get_mesh(*LAYOUTS["2x2"])
    parallel = parallelize(_build("regression"), mesh, data_parallel, fsdp_units=functools.partial(default_fsdp_units, min_params=0))
    domain, replica = domain_mesh(mesh), mesh.get_local_rank(0)
    scatters = 0
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        nonlocal scatters
        scatters += 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        for micro in range(2):
            batch = {name: t[replica : replica + 1] * (micro + 1) for name, t in _batch().items()}
            with parallel.gradient_sync(sync_each or micro == 1):
                x, condition, target = (distribute_tensor(batch[k].contiguous(), domain, [Shard(2)]) for k in ("x", "condition", "target"))
                ((_call("regression", parallel, x, condition, batch["sigma"]) - target) ** 2).mean().backward()
    finally:
        dist.reduce_scatter_single = reduce_scatter
    return {name: _full(p.grad).clone() for name, p in parallel.model.named_parameters()}, scatters


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_micro_batches_but_the_last_skip_the_data_reduction(data_parallel):
    """``ParallelModel.gradient_sync(False)``: the replicas reduce the accumulated gradients once, and
    they equal those reduced after every micro-batch; under FSDP, one reduce-scatter per unit instead
    of one per unit and micro-batch."""
    each = run_on_ranks(4, _accumulated_grads, data_parallel, True, timeout=180.0)
    once = run_on_ranks(4, _accumulated_grads, data_parallel, False, timeout=180.0)
    for (grads_each, scatters_each), (grads_once, scatters_once) in zip(each, once):
        for name, grad in grads_each.items():
            assert (grads_once[name] - grad).abs().max().item() < 1e-6, name
        if data_parallel == "fsdp":
            assert scatters_each == 2 * scatters_once > 0


def _step_over_c10d(kind: str, data_parallel: str, layout: tuple[int, int]) -> dict[str, float]:
    mesh = get_mesh(layout, ("data", "domain"))
    with collectives_over_c10d():
        return step_against_one_device(kind, mesh, data_parallel)


@pytest.mark.parametrize("data_parallel,layout", [("fsdp", (2, 2)), ("none", (1, 2))])
def test_matches_single_device_over_c10d(data_parallel, layout):
    """The step of a GPU job: every exchange and the gradient buckets over torch's collectives."""
    ranks = math.prod(layout)
    for rank, worst in enumerate(run_on_ranks(ranks, _step_over_c10d, "regression", data_parallel, layout, timeout=180.0)):
        for key in ("output", "input_grad", "param_grad", "param_after_step"):
            assert worst[key] < 1e-4, f"rank {rank}: {key} differs by {worst[key]:.3e}"


def _wrappers_over_one_replica(data_parallel: str) -> tuple[set[str], int]:
    from torch.distributed.fsdp import FSDPModule

    parallel = parallelize(_build("regression"), get_mesh((1, 2), ("data", "domain")), data_parallel)
    wrappers = sum(isinstance(m, (FSDPModule, nn.parallel.DistributedDataParallel)) for m in parallel.modules())
    return {type(p).__name__ for p in parallel.model.parameters()}, wrappers


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_one_data_replica_runs_unwrapped(data_parallel):
    """A data axis of size 1 has nothing to shard or average: plain parameters, no FSDP or DDP
    wrapper (whose per-unit gathers over one rank cost a CPU step 18%)."""
    for types, wrappers in run_on_ranks(2, _wrappers_over_one_replica, data_parallel):
        assert types == {"Parameter"} and wrappers == 0


def _bf16_close(data_parallel: str) -> float:
    return bf16_gradients_against_fp32(get_mesh((2, 1), ("data", "domain")), data_parallel)


def bf16_gradients_against_fp32(mesh, data_parallel: str) -> float:
    """bf16 compute stays within bf16 rounding of the fp32 single-device gradients: the largest
    difference relative to each gradient's scale."""
    device = _mesh_device(mesh)
    batch = {name: t.to(device) for name, t in _batch().items()}
    model = _build("regression").to(device)
    reference = copy.deepcopy(model)
    ref_loss = ((reference(batch["x"], batch["condition"]) - batch["target"]) ** 2).mean()
    ref_loss.backward()
    parallel = parallelize(model, mesh, data_parallel, mixed_precision="bf16")
    replicas, replica = mesh.size(0), mesh.get_local_rank(0)
    domain = domain_mesh(mesh)
    rows = slice(replica * GLOBAL_BATCH // replicas, (replica + 1) * GLOBAL_BATCH // replicas)
    out = parallel(distribute_tensor(batch["x"][rows], domain, [Shard(2)]), distribute_tensor(batch["condition"][rows], domain, [Shard(2)]))
    assert out.dtype == torch.bfloat16
    loss = ((out.float() - distribute_tensor(batch["target"][rows], domain, [Shard(2)])) ** 2).mean()
    loss.backward()
    ref_params = dict(reference.named_parameters())
    worst = 0.0
    for name, param in parallel.model.named_parameters():
        grad = _full(param.grad)
        assert grad.dtype == torch.float32
        scale = ref_params[name].grad.abs().max().item() + 1e-3
        worst = max(worst, (grad - ref_params[name].grad).abs().max().item() / scale)
    return worst


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_bf16_compute_fp32_gradients(data_parallel):
    for worst in run_on_ranks(2, _bf16_close, data_parallel, timeout=120.0):
        assert worst < 0.1


def _none_with_replicas() -> str:
    mesh = get_mesh((2, 1), ("data", "domain"))
    try:
        parallelize(nn.Linear(2, 2), mesh, "none")
    except ValueError as error:
        return str(error)
    return ""


def test_no_data_parallel_refuses_replicas():
    for message in run_on_ranks(2, _none_with_replicas):
        assert "data_parallel='none'" in message and "2 data replicas" in message


def test_bad_arguments():
    with pytest.raises(ValueError, match="data_parallel must be"):
        parallelize(nn.Linear(2, 2), None, "zero3")  # type: ignore[arg-type]


def test_adapter_restore_requires_forward():
    with pytest.raises(RuntimeError, match="before any forward"):
        FSDPOutputTensorAdapter(nn.Identity()).restore(torch.ones(1))


def _adapter_round_trip() -> tuple[str, str, list[int]]:
    mesh = get_mesh((2,), ("domain",))
    adapter = FSDPOutputTensorAdapter(nn.Conv2d(1, 1, 3, padding=1))
    x = distribute_tensor(torch.randn(1, 1, 5, 4), mesh, [Shard(2)])
    local = adapter(x)
    restored = adapter.restore(local)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrong = ""
        try:
            adapter.restore([local, local])
        except RuntimeError as error:
            wrong = str(error)
    return type(local).__name__, wrong, list(restored.shape)


def test_adapter_hands_out_slabs_and_restores_layout():
    for kind, wrong, shape in run_on_ranks(2, _adapter_round_trip):
        assert kind == "Tensor"
        assert "restore got 2 outputs" in wrong
        assert shape == [1, 1, 5, 4]


def _train_five_steps(layout: tuple[int, int], data_parallel: str) -> dict[str, torch.Tensor]:
    """Five AdamW steps on a fixed stream of global batches; returns the final parameters."""
    mesh = get_mesh(layout, ("data", "domain"))
    parallel = parallelize(_build("regression"), mesh, data_parallel)
    optim = _optimizer(parallel.model)
    domain = domain_mesh(mesh)
    replicas, replica = mesh.size(0), mesh.get_local_rank(0)
    for step in range(5):
        gen = torch.Generator().manual_seed(100 + step)
        x, condition, target = (torch.randn(4, c, *GRID, generator=gen) for c in (STATE, COND, STATE))
        rows = slice(replica * 4 // replicas, (replica + 1) * 4 // replicas)
        out = parallel(distribute_tensor(x[rows], domain, [Shard(2)]), distribute_tensor(condition[rows], domain, [Shard(2)]))
        loss = ((out - distribute_tensor(target[rows], domain, [Shard(2)])) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    return {name: _full(p.detach()).clone() for name, p in parallel.model.named_parameters()}


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_five_training_steps_agree_across_layouts(data_parallel):
    reference = run_on_ranks(1, _train_five_steps, (1, 1), data_parallel, timeout=180.0)[0]
    for layout in [(2, 1), (1, 2)]:
        for rank, params in enumerate(run_on_ranks(2, _train_five_steps, layout, data_parallel, timeout=180.0)):
            for name, value in params.items():
                diff = (value - reference[name]).abs().max().item()
                assert diff < 1e-4, f"layout {layout} rank {rank}: {name} differs from 1x1 by {diff:.3e}"


def _inner_input_types(layout: tuple[int, int], data_parallel: str) -> tuple[set[str], str, tuple]:
    """The types a conv inside the model sees, and the output's type and placements."""
    mesh = get_mesh(layout, ("data", "domain"))
    model = _build("regression")
    seen: set[str] = set()
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.register_forward_pre_hook(lambda _, inputs: seen.add(type(inputs[0]).__name__))
    parallel = parallelize(model, mesh, data_parallel)
    domain = domain_mesh(mesh)
    batch = _batch()
    rows = slice(mesh.get_local_rank(0), mesh.get_local_rank(0) + 1)
    out = parallel(distribute_tensor(batch["x"][rows], domain, [Shard(2)]), distribute_tensor(batch["condition"][rows], domain, [Shard(2)]))
    out.sum().backward()
    return seen, type(out).__name__, tuple(out.placements)


@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)])
def test_one_rank_domain_runs_the_model_on_plain_slabs(layout):
    """On a one-rank domain the model sees plain tensors (no ShardTensor dispatch per op); on two
    domain ranks it sees ShardTensors.  The output is a ShardTensor laid out like the input."""
    data_parallel = "ddp" if layout[0] > 1 else "none"
    for seen, out_type, placements in run_on_ranks(math.prod(layout), _inner_input_types, layout, data_parallel):
        assert seen == ({"Tensor"} if layout[1] == 1 else {"ShardTensor"})
        assert out_type == "ShardTensor" and placements == (Shard(2),)
