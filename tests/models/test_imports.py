"""Models stay plain PyTorch: nothing under models/ imports physics_dp (its sharding least of all).

If a model needed a change to run sharded, the framework would be missing an op."""

from __future__ import annotations

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "models"


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def test_models_import_nothing_from_physics_dp():
    files = sorted(MODELS.rglob("*.py"))
    assert files, f"no model sources found under {MODELS}"
    offenders = {
        str(path.relative_to(MODELS)): name
        for path in files
        for name in _imported_modules(path)
        if name == "physics_dp" or name.startswith("physics_dp.")
    }
    assert not offenders, f"models import physics_dp: {offenders}"
