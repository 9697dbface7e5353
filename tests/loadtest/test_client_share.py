"""The client-share benchmark runs against a real floor server: every contender measured, the same rows answered."""

from __future__ import annotations

from pathlib import Path

from loadtest.probes.client_share import BASELINE, measure


def test_every_contender_is_measured_against_the_floor(tmp_path: Path) -> None:
    results = measure(batch=64, dim=8, rounds=2, calls=5, workdir=tmp_path)  # asserts HPSClient's rows first
    assert BASELINE in results and "HPSClient.lookup" in results and len(results) == 6
    assert all(r["cpu_us"] >= 0 and r["wall_us"] > 0 for r in results.values())
