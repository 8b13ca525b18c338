"""From the ``data`` config to this rank's datasets and loaders, and batches to ShardTensors.

Each domain rank reads only its rows of every sample (the default balanced split, the one
``ShardTensor.from_local(..., sharding_shapes="chunk")`` assumes); data-parallel ranks read
different samples.  Statistics are computed once, on global rank 0, and shared.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..config import DataConfig
from ..data import DataSpec, ShardedLoader, Stats, WeatherDataset, load_or_compute_stats
from ..distributed.agreement import on_rank0
from ..shard_tensor import Shard
from ..shard_tensor.conversions import from_local_with_spec, spec_from_local
from ..shard_tensor.spec import CHANNELS_LAST_ORDERS

__all__ = ["DataBundle", "build_data", "data_spec", "row_window", "shard_batch", "FIELD_KEYS"]

FIELD_KEYS = ("state", "target", "mask", "background", "invariants")


def default_cache_dir() -> str:
    return os.environ.get("PHYSICS_DP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "physics_dp"))


def _file_list(value: Any) -> str | list[str] | None:
    """A path or glob as given; a list (from the command line or YAML) as a plain list of them."""
    return value if value is None or isinstance(value, str) else [str(item) for item in value]


def data_spec(cfg: DataConfig) -> DataSpec:
    """The netCDF files to read: the user's, or the built-in synthetic set (written once, shared
    by every process through a lock file)."""
    files = dict(
        state_files=_file_list(cfg.state_files),
        state_variables=list(cfg.state_variables),
        background_files=_file_list(cfg.background_files),
        background_variables=list(cfg.background_variables),
        invariant_file=cfg.invariant_file,
        invariant_variables=list(cfg.invariant_variables),
        level=cfg.level,
    )
    if cfg.source == "synthetic":
        from ..data.synthetic import write_synthetic_dataset

        syn = cfg.synthetic
        root = cfg.root or os.path.join(
            default_cache_dir(), f"synthetic-t{syn.n_times}-{syn.height}x{syn.width}-seed{syn.seed}"
        )
        paths = write_synthetic_dataset(root, n_times=syn.n_times, height=syn.height, width=syn.width, seed=syn.seed)
        files = dict(
            state_files=paths.state_glob,
            state_variables=list(paths.state_variables),
            background_files=paths.background_glob,
            background_variables=list(paths.background_variables),
            invariant_file=paths.invariant_file,
            invariant_variables=list(paths.invariant_variables),
        )
    return DataSpec(
        **files,
        lead_time=cfg.lead_time,
        train_times=tuple(cfg.train_times) if cfg.train_times is not None else None,
        valid_times=tuple(cfg.valid_times) if cfg.valid_times is not None else None,
        stats_file=cfg.stats_file,
    )


def row_window(height: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [r0, r1) of part ``index`` in the balanced split of ``height`` rows (larger parts first)."""
    sizes = [len(chunk) for chunk in torch.arange(height).tensor_split(parts)]
    start = sum(sizes[:index])
    return start, start + sizes[index]


def shared_stats(spec: DataSpec) -> Stats:
    """Statistics computed (or read from the cache) by rank 0, shared with the others; a failure
    there is the same error on every rank."""
    return on_rank0(lambda: load_or_compute_stats(spec))


@dataclass
class DataBundle:
    spec: DataSpec
    stats: Stats
    train: WeatherDataset
    valid: WeatherDataset
    train_loader: ShardedLoader
    grid_shape: tuple[int, int]
    channel_names: dict[str, list[str]]

    def close(self) -> None:
        for item in (self.train_loader, self.train, self.valid):
            item.close()


def build_data(cfg: DataConfig, mesh: DeviceMesh, per_rank_batch: int, seed: int, micro_batches: int = 1) -> DataBundle:
    """Datasets reading this domain rank's rows and loaders for this data rank (``micro_batches``
    batches of ``per_rank_batch`` samples per optimizer step)."""
    spec = data_spec(cfg)
    stats = shared_stats(spec)
    names = mesh.mesh_dim_names
    domain_size, domain_rank = mesh.size(names.index("domain")), mesh.get_local_rank("domain")
    data_size, data_rank = mesh.size(names.index("data")), mesh.get_local_rank("data")
    probe = WeatherDataset(spec, "train", stats=stats, rows=(0, 1))
    height, width = probe.grid_shape
    probe.close()
    if height < domain_size:
        raise ValueError(f"the grid has {height} rows, fewer than parallel.domain_size={domain_size}; use fewer domain ranks")
    rows = row_window(height, domain_size, domain_rank)
    train = WeatherDataset(spec, "train", rows=rows, stats=stats)
    valid = WeatherDataset(spec, "valid", rows=rows, stats=stats)
    train_loader = ShardedLoader(
        train, per_rank_batch, data_rank, data_size, seed, shuffle=True, prefetch=cfg.prefetch, micro_batches=micro_batches
    )
    return DataBundle(spec, stats, train, valid, train_loader, (height, width), train.channel_names)


def shard_batch(
    batch: dict[str, torch.Tensor],
    domain_mesh: DeviceMesh,
    grid_shape: tuple[int, int],
    device: torch.device | None = None,
    channels_last: bool = False,
) -> dict[str, torch.Tensor]:
    """Wrap each (n, C, rows, W) slab, moved to ``device``, as a ShardTensor of the global
    (n, C, H, W) field; other entries pass through.

    ``channels_last`` lays every field out channels last, so the model's activations follow
    whatever its parameters' layout (FSDP2 keeps them row-major).  The layout is set by the
    caller, not read off each slab: a slab of one or no rows looks row-major too, and every rank
    must agree on its spec.
    """
    out: dict[str, torch.Tensor] = {}
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    for key, value in batch.items():
        if key in FIELD_KEYS:
            shape = (value.shape[0], value.shape[1], *grid_shape)
            local = value.to(device, non_blocking=True, memory_format=memory_format)
            spec = spec_from_local(local, domain_mesh, [Shard(2)], "chunk", shape)
            out[key] = from_local_with_spec(local, spec.in_order(CHANNELS_LAST_ORDERS[4]) if channels_last else spec)
        else:
            out[key] = value
    return out
