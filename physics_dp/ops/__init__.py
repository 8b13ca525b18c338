"""Sharded implementations of torch ops, registered with ShardTensor's dispatch registries.

Importing this package imports every op module in it; each registers its handlers at import,
so models keep calling the ordinary ``torch.nn`` / ``torch.nn.functional`` API.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
