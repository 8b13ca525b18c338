"""Weather data from netCDF files: per-rank hyperslab reads, normalization statistics, batching.

Names: ``DataSpec`` (config), ``WeatherDataset`` (one rank's window of each sample),
``compute_stats`` / ``load_or_compute_stats`` (train-split statistics, cached as JSON),
``ShardedLoader`` (data-parallel batches with prefetching) and ``write_synthetic_dataset``.
"""

from .catalog import DataReadError, ReadCounts
from .dataset import DataSpec, WeatherDataset
from .loader import ShardedLoader, collate
from .stats import ChannelStats, Stats, compute_stats, load_or_compute_stats

__all__ = [
    "ChannelStats",
    "DataReadError",
    "DataSpec",
    "ReadCounts",
    "ShardedLoader",
    "Stats",
    "SyntheticPaths",
    "WeatherDataset",
    "collate",
    "compute_stats",
    "load_or_compute_stats",
    "write_synthetic_dataset",
]


def __getattr__(name: str):
    # Imported on first use, not at package import, so `python -m physics_dp.data.synthetic` does
    # not find the module already loaded (runpy would warn and run a second copy).
    if name in ("SyntheticPaths", "write_synthetic_dataset"):
        from . import synthetic

        return getattr(synthetic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
