"""Batches to ShardTensors: channels-last fields keep their layout on every rank, and a model
whose parameters FSDP2 keeps row-major runs channels last from them, equal to one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from physics_dp.testing import run_on_ranks

# fields of 3 channels over a (rows, 6) grid, the way a loader hands them to a domain rank
_FIELDS = ("state", "target")


def _global_batch(rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {key: torch.randn(2, 3, rows, 6, generator=gen) for key in _FIELDS} | {"sigma": torch.ones(2)}


def _sharded_fields(rows: int, channels_last: bool) -> dict:
    from physics_dp.distributed import DistributedManager
    from physics_dp.shard_tensor.spec import balanced_sizes
    from physics_dp.training.data_setup import shard_batch

    manager = DistributedManager()
    mesh = manager.initialize_mesh((manager.world_size,), ("domain",))
    sizes = balanced_sizes(rows, manager.world_size)
    first = sum(sizes[: manager.rank])
    whole = _global_batch(rows)
    slabs = {key: value[:, :, first : first + sizes[manager.rank]] if key in _FIELDS else value for key, value in whole.items()}
    batch = shard_batch(slabs, mesh, (rows, 6), torch.device("cpu"), channels_last)
    return {
        "strides": {key: batch[key].stride() for key in _FIELDS},
        "local_channels_last": {key: batch[key].to_local().is_contiguous(memory_format=torch.channels_last) for key in _FIELDS},
        "equal": all(torch.equal(batch[key].full_tensor(), whole[key]) for key in _FIELDS),
        "passed_through": batch["sigma"] is slabs["sigma"],
    }


@pytest.mark.parametrize("ranks,rows", [(2, 7), (3, 5), (3, 2)])  # uneven splits; 2 rows on 3 ranks leave one slab empty
@pytest.mark.parametrize("channels_last", [True, False])
def test_fields_become_shard_tensors_in_the_asked_layout_on_every_rank(ranks, rows, channels_last):
    results = run_on_ranks(ranks, _sharded_fields, rows, channels_last)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    expected = torch.empty(2, 3, rows, 6).contiguous(memory_format=layout).stride()
    for result in results:
        assert result["equal"] and result["passed_through"]
        assert set(result["strides"].values()) == {expected}  # one global layout, whatever the slab's extent
        assert all(result["local_channels_last"].values()) == channels_last


class _Block(nn.Module):
    """Convolution, group norm, SiLU, convolution: what a U-Net level does."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(6, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.second = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, state: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        return self.second(torch.nn.functional.silu(self.norm(self.first(torch.cat([state, condition], dim=1)))))


def _block_under_fsdp(rows: int) -> dict:
    """Data replica d of a (2, 2) ("data", "domain") mesh trains on sample d of the batch."""
    from physics_dp.distributed import DistributedManager
    from physics_dp.nn import domain_mesh, parallelize
    from physics_dp.shard_tensor.spec import balanced_sizes
    from physics_dp.training.data_setup import shard_batch

    mesh = DistributedManager().initialize_mesh((2, 2), ("data", "domain"))
    replica, domain = mesh.get_local_rank("data"), mesh.get_local_rank("domain")
    torch.manual_seed(0)
    model = _Block()
    reference = _Block()
    reference.load_state_dict(model.state_dict())
    parallel = parallelize(model, mesh, "fsdp")
    layouts = []
    for module in (model.first, model.norm, model.second):
        module.register_forward_hook(lambda _m, _args, out: layouts.append(out.to_local().is_contiguous(memory_format=torch.channels_last)))
    whole = _global_batch(rows)
    sizes = balanced_sizes(rows, 2)
    first = sum(sizes[:domain])
    mine = {k: v[replica : replica + 1, :, first : first + sizes[domain]] for k, v in whole.items() if k in _FIELDS}
    batch = shard_batch(mine, domain_mesh(mesh), (rows, 6), torch.device("cpu"), channels_last=True)
    out = parallel(batch["state"], batch["target"])
    out.square().mean().backward()  # FSDP averages the replicas' gradients: the whole batch's mean
    expected = reference(whole["state"], whole["target"])
    expected.square().mean().backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {
        "layouts": layouts,
        "params_row_major": all(p.to_local().is_contiguous() for p in model.parameters()),
        "out_error": (out.full_tensor() - expected[replica : replica + 1]).abs().max().item(),
        "grad_error": max((grads[name] - p.grad).abs().max().item() for name, p in reference.named_parameters()),
    }


@pytest.mark.parametrize("rows", [8, 9])
def test_channels_last_batches_run_an_fsdp_model_channels_last(rows):
    """FSDP2 shards row-major parameters only, so ``training.channels_last`` lays out the batch
    instead: every activation is then channels last, and the results are one device's."""
    for result in run_on_ranks(4, _block_under_fsdp, rows):
        assert result["params_row_major"]
        assert result["layouts"] == [True, True, True]
        assert result["out_error"] < 1e-5 and result["grad_error"] < 1e-5
