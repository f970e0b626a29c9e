"""benchmarks/server_latency.py (the latency claims the hostile server tests no longer time): its
summary takes medians over rounds and says which documented claims held."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import server_latency  # noqa: E402


def _round(health_max: float, ratio: float) -> dict:
    beside = {"alone_p50_s": 1.0, "loaded_p50_s": ratio, "ratio": ratio, "health_max_s": 0.1}
    return {
        "half_open": {"health_p50_s": 0.01, "health_max_s": health_max, "probes": 100},
        "monopoly": beside,
        "megabyte_bodies": beside,
    }


def test_summary_is_the_median_round_and_checks_the_claims():
    summary = server_latency._summary([_round(0.2, 1.2), _round(3.0, 1.3), _round(0.4, 9.0)])
    assert summary["half_open"]["health_max_s"] == 0.4
    assert summary["monopoly"]["ratio"] == 1.3
    assert summary["claims"] == {
        "health_under_half_open_below_1s": True,
        "beside_monopoly_within_2x": True,
        "beside_megabyte_bodies_within_1.5x": True,
        "health_beside_megabyte_bodies_below_0.5s": True,
    }
    slow = server_latency._summary([_round(2.0, 1.8)])["claims"]
    assert not slow["health_under_half_open_below_1s"] and not slow["beside_megabyte_bodies_within_1.5x"]
    assert slow["beside_monopoly_within_2x"]


def test_help_runs():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "server_latency.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--rounds" in out.stdout
