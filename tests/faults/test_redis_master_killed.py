"""A Redis Cluster master SIGKILLed under lookup load: no lookup fails (its keys come from RocksDB, counted as
volatile misses and node errors), and the tier uses the node again once it is back. Latency per phase is printed."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np

from hps_service.client import HPSClient
from hps_service.engine import Source
from tests.faults.support import LookupLoad, readyz, rows_for, wait_for
from tests.helpers import ServerProcess, free_port, write_config

DIM = 16
TOKEN = "fault-admin-token"


def test_master_killed_under_load_loses_no_lookup(redis_cluster_clean, tmp_path: Path) -> None:
    cluster = redis_cluster_clean
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN},
        "cache": {"enabled": False},  # every lookup goes to L2, so the killed node is on the path
        "volatile": {"type": "redis_cluster", "nodes": cluster.nodes, "partitions": 16,
                     "socket_timeout_s": 0.5, "node_retry_after_s": 0.5},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM}]}],
    })
    keys = np.arange(1, 3001, dtype=np.int64)
    with ServerProcess(cfg, grpc_port) as srv:
        r = httpx.put(f"http://127.0.0.1:{http_port}/v1/models/m/tables/item/embeddings",
                      json={"keys": keys.tolist(), "vectors": rows_for(keys, 1, DIM).tolist(), "version": 1},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text
        load = LookupLoad(srv.target, "m", "item", keys, lambda k: rows_for(k, 1, DIM)).start()
        try:
            time.sleep(2.0)
            load.phase = "during"
            cluster.kill(0)
            time.sleep(3.0)
            load.phase = "recovering"
            cluster.restart(0)  # comes back empty (no persistence): its keys miss, are read from RocksDB, promoted

            def volatile_again() -> bool:
                recent = load.sources.get("recovering", [])[-20:]
                return len(recent) == 20 and all((s == Source.VOLATILE).all() for s in recent[-5:])

            wait_for(volatile_again, 30, "every key answered by the volatile tier again")
            with HPSClient(srv.target) as client:  # keys not asked since the restart are promoted now
                client.lookup("m", "item", keys)
            load.phase = "after"
            time.sleep(2.0)
        finally:
            load.stop()
        stats = httpx.get(f"http://127.0.0.1:{http_port}/v1/stats", timeout=10).json()
        status, body = readyz(http_port)
    print(f"\nredis master killed: {load.requests} lookups, {len(load.errors)} errors, "
          f"{load.wrong_rows} wrong answers; {load.report()}")
    assert "models" in stats, stats
    volatile = stats["models"]["m"]["tables"]["item"]["volatile"]
    print(f"volatile tier: misses {volatile['misses']}, node_failures {volatile['node_failures']}, "
          f"node_skips {volatile['node_skips']}, failed_keys {volatile['failed_keys']}")
    assert load.errors == [] and load.wrong_rows == 0
    during = np.concatenate(load.sources["during"])
    assert (during == Source.PERSISTENT).any(), "the killed node's keys must have come from RocksDB"
    assert set(np.unique(during)) <= {Source.VOLATILE, Source.PERSISTENT}
    assert volatile["failed_keys"] > 0 and volatile["misses"] > 0
    assert (np.concatenate(load.sources["after"]) == Source.VOLATILE).all()
    assert status == 200, body
