"""Smoke test of ``benchmarks/sync_ablation.py``: each ablation leaves out the collectives it names.

Counts collectives, never time: the real step issues every kind, each ablation strictly fewer, and
the originals are restored afterwards (the real step's count again).
"""

from __future__ import annotations

from physics_dp.testing import get_mesh, run_on_ranks
from tests.benchmarks._scripts import load_benchmark


def _collectives_per_ablation() -> dict[str, int]:
    script = load_benchmark("sync_ablation")
    mesh = get_mesh((2,))
    counts = {name: script.time_steps(mesh, (16, 24), 1, name)[1] for name in script.ABLATIONS}
    counts["all again"] = script.time_steps(mesh, (16, 24), 1, "all")[1]
    return counts


def test_each_ablation_leaves_out_its_collectives():
    for counts in run_on_ranks(2, _collectives_per_ablation):
        assert counts["all again"] == counts["all"]
        assert counts["neither"] < counts["no-small-reduces"] < counts["all"]
        assert counts["neither"] < counts["no-p2p"] < counts["all"]
