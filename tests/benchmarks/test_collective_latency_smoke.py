"""Smoke test of ``benchmarks/collective_latency.py``: every latency is measured on real ranks.

Never how long they took: only that each figure the script prints exists and is positive.
"""

from __future__ import annotations

from physics_dp.testing import get_mesh, run_on_ranks
from tests.benchmarks._scripts import load_benchmark


def _tiny() -> dict[str, dict[str, float]]:
    mesh = get_mesh((2,))
    script = load_benchmark("collective_latency")
    group = mesh.get_group(0)
    return {t: script.measure(group, numel=8, calls=3, work_mib=0.01, transport=t) for t in script.TRANSPORTS}


def test_every_latency_is_measured_on_both_transports():
    for by_transport in run_on_ranks(2, _tiny):
        assert set(by_transport) == {"gloo", "host channel"}
        for result in by_transport.values():
            assert set(result) == {"idle_median_us", "idle_p90_us", "after_work_median_us", "after_work_p90_us"}
            assert all(value > 0 for value in result.values())
