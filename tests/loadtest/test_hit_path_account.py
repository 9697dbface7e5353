"""The hit-path account runs on a real in-process server: every layer measured on an all-L1-hit request."""

from __future__ import annotations

from loadtest.probes.hit_path_account import measure


def test_every_layer_is_measured_on_an_all_hit_request() -> None:
    layers = measure(batch=64, dim=8, rows=2000, calls=10)  # asserts itself that every key hits L1
    assert [name.split(" ")[0] for name, _ in layers][:4] == [
        "servicer._serve_one", "servicer.lookup", "engine.lookup", "TableCache.lookup"]
    assert all(us > 0 for _, us in layers)
