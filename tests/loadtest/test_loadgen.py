"""The load generator against a real in-process HPSServer (gRPC + REST on free ports): its report adds up.

Workers are real processes driving grpc.aio; nothing here asserts a time or a rate beyond "some".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hps_service.config import load_config
from hps_service.serve.process import HPSServer
from loadtest.harness.loadgen import LoadSpec, run_load, save
from loadtest.harness.workload import KeySampler
from tests.helpers import free_port

DIM, ROWS = 8, 5000


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HPSServer, Path]]:
    """A server whose demo.item table holds ROWS rows, and a .npy of their keys."""
    tmp = tmp_path_factory.mktemp("loadgen")
    config = load_config(
        None,
        server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "grpc_workers": 4},
        cache={"enabled": True, "capacity": 0.2},  # every level reports a hit rate
        volatile={"type": "hashmap", "capacity_rows": 100_000},
        persistent={"type": "rocksdb", "path": str(tmp / "rocksdb"), "block_cache_mb": 8},
        models=[{"name": "demo", "tables": [{"name": "item", "dim": DIM}, {"name": "user", "dim": DIM}]}],
    )
    server = HPSServer(config)
    server.start()
    try:
        keys = np.arange(ROWS, dtype=np.int64) * 13 + 5
        rows = np.random.default_rng(0).standard_normal((ROWS, DIM), dtype=np.float32)
        for table in ("item", "user"):
            server.engine.apply_updates("demo", table, keys, rows, 1)
        np.save(tmp / "keys.npy", keys)
        yield server, tmp / "keys.npy"
    finally:
        server.stop(grace=1)


def _spec(server: HPSServer, keys_file: Path, **kw: object) -> LoadSpec:
    base = LoadSpec(target=f"127.0.0.1:{server.grpc_port}", http_target=f"127.0.0.1:{server.http_port}",
                    model="demo", tables=("item",), batch=64, workers=2, concurrency=4, duration_s=2.0,
                    warmup_s=0.5, keys_file=str(keys_file), timeout_s=5.0)
    return replace(base, **kw)


def _check_consistent(report: dict) -> None:
    assert report["requests"] == report["responses"] + sum(report["errors"].values())
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert report["qps"] == pytest.approx(report["responses"] / report["duration_s"])


def test_closed_loop_report_adds_up(served: tuple[HPSServer, Path], tmp_path: Path) -> None:
    server, keys_file = served
    spec = _spec(server, keys_file, tables=("item", "user"))
    report = run_load(spec)
    _check_consistent(report)
    assert report["errors"] == {} and report["dropped"] == 0
    assert report["responses"] > 0
    # every answered request carried batch keys for each of the two tables
    assert report["keys_per_s"] * report["duration_s"] == report["responses"] * spec.batch * 2
    assert 0.0 <= report["client_cache_hit_rate"] <= 1.0
    server_rates = report["server_hit_rate"]
    assert server_rates is not None and set(server_rates) == {"cache", "volatile", "persistent"}
    assert report["server_hit_rate"]["cache"] is not None and 0.0 <= server_rates["cache"] <= 1.0
    assert sum(p["qps"] for p in report["timeline"]) > 0
    written = save(report, [], tmp_path, "closed")
    assert [p.name for p in written] == ["closed.json", "closed-hit-rate.png"]
    assert all(p.stat().st_size > 0 for p in written)


def test_open_loop_counts_every_scheduled_send(served: tuple[HPSServer, Path]) -> None:
    server, keys_file = served
    report = run_load(_spec(server, keys_file, mode="open", qps=40.0, duration_s=1.5))
    _check_consistent(report)
    assert report["errors"] == {}
    # 20 sends/s per worker on a fixed schedule over the 1.5 s window: 30 each, give or take the boundary one
    assert 58 <= report["requests"] + report["dropped"] <= 62


def test_errors_are_counted_by_status(served: tuple[HPSServer, Path]) -> None:
    server, keys_file = served
    report = run_load(_spec(server, keys_file, tables=("no_such_table",), duration_s=1.0))
    assert report["responses"] == 0
    assert set(report["errors"]) == {"NOT_FOUND"}
    assert report["requests"] == report["errors"]["NOT_FOUND"] > 0


def test_zipf_sampler_prefers_low_ranks() -> None:
    keys = np.arange(1000, dtype=np.int64) * 3
    pool = KeySampler(keys, "zipf", 1.05).pool(50, 200, seed=1)
    counts = np.bincount((pool // 3).ravel(), minlength=1000)
    assert counts[0] > counts[10] > counts[500:].mean()
    assert set(np.unique(pool)) <= set(keys.tolist())
    uniform = KeySampler(keys, "uniform").pool(50, 200, seed=1)
    assert np.bincount((uniform // 3).ravel(), minlength=1000)[0] < counts[0]
