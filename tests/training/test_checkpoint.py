"""Checkpointer: resume on other parallel layouts bitwise, atomic writes, pruning, errors, export.

Real gloo ranks (1, 2, 4) share ``tmp_path``, which stands in for a shared filesystem. The model
is tiny (1366 parameters, one uneven FSDP dim) and every rank computes the same thing, so the
full state after a load can be compared bitwise with the full state at save time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.training.checkpoint import Checkpointer, CheckpointMismatchError, export_state_dict

# (data, domain, data_parallel "fsdp" | "ddp" | "none"): world size is data * domain
Layout = tuple[int, int, str]


def _tiny_model(out_features: int = 7, extra_layer: bool = False) -> nn.Sequential:
    layers = [
        nn.Conv2d(2, 5, 3, padding=1),  # 5 output channels: uneven FSDP shards over 2 ranks
        nn.ReLU(),
        nn.Conv2d(5, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, out_features),
    ]
    if extra_layer:
        layers.append(nn.Linear(out_features, 3))
    return nn.Sequential(*layers)


def _build(layout: Layout, seed: int, **model_kwargs):
    """Model (FSDP2 or DDP over the data axis, or plain), AdamW and a decaying LR schedule."""
    data, domain, data_parallel = layout
    torch.manual_seed(seed)
    model = _tiny_model(**model_kwargs)
    if data_parallel == "fsdp":
        fully_shard(model, mesh=get_mesh((data, domain), ("data", "domain"))["data"])
    elif data_parallel == "ddp":
        group = get_mesh((data, domain), ("data", "domain")).get_group("data")
        model = DistributedDataParallel(model, process_group=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    return model, optimizer, scheduler


def _train(model: nn.Module, optimizer, scheduler, steps: int) -> None:
    """Real AdamW steps on batches drawn from the global RNG (so resuming must restore it)."""
    for _ in range(steps):
        x = torch.randn(3, 2, 4, 4)
        model(x).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _full_state(model: nn.Module, optimizer) -> dict:
    """Unsharded parameters and AdamW state keyed by FQN, plus the current learning rate."""
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {
        "params": {k: v.detach().clone() for k, v in model_state.items()},
        "optim": {k: {n: t.clone() for n, t in s.items()} for k, s in optim_state["state"].items()},
        "lr": optimizer.param_groups[0]["lr"],
    }


def _assert_bitwise_equal(actual: dict, expected: dict) -> None:
    assert actual["lr"] == expected["lr"]
    assert actual["params"].keys() == expected["params"].keys()
    for key, value in expected["params"].items():
        assert torch.equal(actual["params"][key], value), key
    assert actual["optim"].keys() == expected["optim"].keys()
    for key, state in expected["optim"].items():
        assert state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for name, value in state.items():
            assert torch.equal(actual["optim"][key][name], value), (key, name)


# ---- rank functions (module level so the rank pool can import them) --------------------------


def _first_run(directory: str, layout: Layout, steps: int) -> dict:
    model, optimizer, scheduler = _build(layout, seed=0)
    torch.manual_seed(1234)
    _train(model, optimizer, scheduler, steps)
    Checkpointer(directory).save(steps, model, optimizer, scheduler, extra={"rng": torch.get_rng_state()})
    return _full_state(model, optimizer)


def _resume_check_and_resave(directory: str, layout: Layout) -> tuple[dict, dict, int]:
    """Load into a differently initialised model, return its full state, then train one step and save."""
    model, optimizer, scheduler = _build(layout, seed=99)
    checkpointer = Checkpointer(directory)
    resumed = checkpointer.load(model, optimizer, scheduler)
    loaded = _full_state(model, optimizer)
    torch.set_rng_state(resumed["extra"]["rng"])
    _train(model, optimizer, scheduler, 1)
    step = resumed["step"] + 1
    checkpointer.save(step, model, optimizer, scheduler, extra={"rng": torch.get_rng_state()})
    return loaded, _full_state(model, optimizer), scheduler.last_epoch


def test_resume_on_other_layouts_is_bitwise(tmp_path):
    directory = str(tmp_path)
    saved = run_on_ranks(2, _first_run, directory, (2, 1, "fsdp"), 2)[0]
    chain: list[Layout] = [
        (1, 2, "fsdp"), (1, 1, "fsdp"), (1, 4, "fsdp"), (1, 2, "none"), (2, 1, "ddp"), (2, 2, "fsdp"),
    ]
    for step, layout in enumerate(chain, start=3):
        results = run_on_ranks(layout[0] * layout[1], _resume_check_and_resave, directory, layout)
        loaded, saved_next, last_epoch = results[0]
        _assert_bitwise_equal(loaded, saved)
        assert last_epoch == step  # the scheduler resumed from the saved step, then stepped once
        assert all(r[2] == last_epoch for r in results)
        saved = saved_next
    assert Checkpointer(directory).latest_step() == 2 + len(chain)


def _run_straight(layout: Layout, steps: int) -> dict:
    model, optimizer, scheduler = _build(layout, seed=0)
    torch.manual_seed(1234)
    _train(model, optimizer, scheduler, steps)
    return _full_state(model, optimizer)


def _resume_and_finish(directory: str, layout: Layout, total_steps: int) -> dict:
    model, optimizer, scheduler = _build(layout, seed=5)
    resumed = Checkpointer(directory).load(model, optimizer, scheduler)
    torch.set_rng_state(resumed["extra"]["rng"])
    _train(model, optimizer, scheduler, total_steps - resumed["step"])
    return _full_state(model, optimizer)


@pytest.mark.parametrize("layout", [(2, 1, "fsdp"), (1, 2, "none")])
def test_continuing_after_resume_matches_uninterrupted_run(tmp_path, layout):
    world = layout[0] * layout[1]
    straight = run_on_ranks(world, _run_straight, layout, 5)[0]
    run_on_ranks(world, _first_run, str(tmp_path), layout, 2)
    resumed = run_on_ranks(world, _resume_and_finish, str(tmp_path), layout, 5)[0]
    _assert_bitwise_equal(resumed, straight)


def _save_steps(directory: str, steps: list[int], keep: int) -> list:
    model, optimizer, scheduler = _build((1, 2, "none"), seed=0)
    checkpointer = Checkpointer(directory, keep=keep)
    for step in steps:
        checkpointer.save(step, model, optimizer, scheduler)
    return sorted(p.name for p in Path(directory).iterdir())


def test_keep_prunes_oldest_and_removes_stale_tmp_dirs(tmp_path):
    stale = tmp_path / "step_000009.tmp-deadbeef"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    names = run_on_ranks(2, _save_steps, str(tmp_path), [1, 2, 3, 4], 2)
    assert names[0] == names[1] == ["latest", "step_000003", "step_000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_000004"
    # Saving an older step (after resuming from it) keeps it, and it becomes latest.
    names = run_on_ranks(2, _save_steps, str(tmp_path), [2], 2)[0]
    assert names == ["latest", "step_000002", "step_000004"]
    assert Checkpointer(tmp_path).latest_step() == 2
    # Re-saving an existing step replaces it.
    names = run_on_ranks(1, _save_steps, str(tmp_path), [2], 2)[0]
    assert names == ["latest", "step_000002", "step_000004"]


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep >= 1"):
        Checkpointer(tmp_path, keep=0)


def _load_mismatched(directory: str, model_kwargs: dict) -> str:
    model, optimizer, _ = _build((1, 2, "none"), seed=0, **model_kwargs)
    try:
        Checkpointer(directory).load(model, optimizer)
    except CheckpointMismatchError as error:
        return str(error)
    return "loaded without error"


def test_mismatched_checkpoint_raises_on_every_rank(tmp_path):
    run_on_ranks(2, _first_run, str(tmp_path), (2, 1, "fsdp"), 1)
    path = str(tmp_path / "step_000001")
    messages = run_on_ranks(2, _load_mismatched, str(tmp_path), {"out_features": 9})
    for message in messages:
        assert "'5.weight'" in message and path in message and "(7, 128)" in message and "(9, 128)" in message
    messages = run_on_ranks(2, _load_mismatched, str(tmp_path), {"extra_layer": True})
    for message in messages:
        assert "'6.weight'" in message and path in message and "does not have it" in message


def _no_checkpoint(directory: str):
    model, optimizer, scheduler = _build((1, 2, "none"), seed=0)
    return Checkpointer(directory).load(model, optimizer, scheduler)


def test_load_without_checkpoint_returns_none_and_missing_step_raises(tmp_path):
    assert run_on_ranks(2, _no_checkpoint, str(tmp_path / "empty")) == [None, None]
    assert Checkpointer(tmp_path).latest_step() is None
    model, optimizer, _ = _build((1, 1, "none"), seed=0)
    with pytest.raises(FileNotFoundError, match="step 7"):
        Checkpointer(tmp_path).load(model, optimizer, step=7)


def _load_step(directory: str, step: int | None) -> str:
    model, optimizer, scheduler = _build((1, 2, "none"), seed=5)
    try:
        return str(Checkpointer(directory).load(model, optimizer, scheduler, step=step)["step"])
    except Exception as error:  # the message each rank would print
        return f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("damage", ["truncate shard", "truncate metadata", "truncate trainer state", "delete shard"])
def test_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_used(tmp_path, damage, caplog):
    run_on_ranks(2, _save_steps, str(tmp_path), [1, 2], 3)
    latest = tmp_path / "step_000002"
    shard = sorted(latest.glob("*.distcp"))[-1]
    victim = {"truncate shard": shard, "delete shard": shard, "truncate metadata": latest / ".metadata",
              "truncate trainer state": latest / "trainer_state.pt"}[damage]
    if damage == "delete shard":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    # An explicit step names the damaged file on every rank, and nothing is moved.
    for message in run_on_ranks(2, _load_step, str(tmp_path), 2):
        assert message.startswith("CheckpointDamagedError") and str(victim) in message, message
    # The default (latest) falls back to the newest intact checkpoint on every rank.
    with caplog.at_level("WARNING"):
        assert Checkpointer(tmp_path).load(*_build((1, 1, "none"), seed=5)[:2]) is not None  # single process too
    assert [r for r in caplog.records if str(victim) in r.getMessage() and "set aside" in r.getMessage()]
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("step_000002.damaged-")]
    assert len(aside) == 1 and not latest.exists()
    assert run_on_ranks(2, _load_step, str(tmp_path), None) == ["1", "1"]
    # Set aside, never pruned: the next saves keep it for inspection.
    names = run_on_ranks(2, _save_steps, str(tmp_path), [2, 3], 2)
    assert aside[0] in names[0] and "step_000001" not in names[0]


def _checkpoint_bytes(directory: str, layout: Layout) -> int:
    _first_run(directory, layout, 2)
    return sum(f.stat().st_size for f in (Path(directory) / "step_000002").iterdir() if f.suffix == ".distcp")


def test_replicated_state_is_written_once(tmp_path):
    """DCP deduplicates replicated tensors: the bytes do not grow with the number of replicas.

    (Each stored chunk carries ~1.5 kB of torch.save framing, so FSDP's two shards per tensor
    cost more than one whole tensor; the comparison is therefore between equal shardings.)
    """
    plain1 = run_on_ranks(1, _checkpoint_bytes, str(tmp_path / "a"), (1, 1, "none"))[0]
    plain4 = run_on_ranks(4, _checkpoint_bytes, str(tmp_path / "b"), (1, 4, "none"))[0]
    fsdp2 = run_on_ranks(2, _checkpoint_bytes, str(tmp_path / "c"), (2, 1, "fsdp"))[0]
    fsdp2_replicated2 = run_on_ranks(4, _checkpoint_bytes, str(tmp_path / "d"), (2, 2, "fsdp"))[0]
    # A second copy of every tensor would add at least 40 %; per-file headers add far less.
    assert plain4 < 1.1 * plain1, (plain1, plain4)
    assert fsdp2_replicated2 < 1.1 * fsdp2, (fsdp2, fsdp2_replicated2)


def _export(path: str, layout: Layout) -> dict:
    model, optimizer, scheduler = _build(layout, seed=0)
    _train(model, optimizer, scheduler, 1)
    export_state_dict(model, path)
    return _full_state(model, optimizer)["params"]


@pytest.mark.parametrize("layout", [(2, 1, "fsdp"), (1, 2, "none")])
def test_export_state_dict_loads_into_plain_model(tmp_path, layout):
    path = tmp_path / "export" / "model.pt"
    expected = run_on_ranks(layout[0] * layout[1], _export, str(path), layout)[0]
    model = _tiny_model()
    model.load_state_dict(torch.load(path))
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]


def test_single_process_without_torch_distributed(tmp_path):
    """A plain script (no process group at all) can save, load and export too."""
    if dist.is_initialized():
        pytest.skip("this pytest process already joined a process group")
    model, optimizer, scheduler = _build((1, 1, "none"), seed=0)
    torch.manual_seed(1234)
    _train(model, optimizer, scheduler, 2)
    Checkpointer(tmp_path).save(2, model, optimizer, scheduler, extra={"epoch": 1})
    expected = _full_state(model, optimizer)
    model2, optimizer2, scheduler2 = _build((1, 1, "none"), seed=1)
    assert Checkpointer(tmp_path).load(model2, optimizer2, scheduler2) == {"step": 2, "extra": {"epoch": 1}}
    _assert_bitwise_equal(_full_state(model2, optimizer2), expected)
