"""``python -m physics_dp.train +experiment=NAME key=value ...`` (also under ``torchrun -m``).

Hydra composes ``configs/train.yaml`` (shipped in the package) with the experiment and the
overrides, checked against the typed schema in :mod:`physics_dp.config`.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .config import register_schema
from .distributed import DistributedManager
from .training.run import train

register_schema()


@hydra.main(version_base=None, config_path="pkg://physics_dp.configs", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    finally:
        DistributedManager().cleanup()


if __name__ == "__main__":
    main()
