"""Redis Cluster or the broker unreachable when `hps serve` starts: it starts degraded (the log and /readyz say
so), serves lookups from the other tiers, does not exit, and picks the backend up once it is reachable."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import httpx
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hps_service.client import HPSClient
from hps_service.engine import Source
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.faults.support import readyz, rows_for, wait_for
from tests.helpers import ServerProcess, free_port, write_config

DIM = 8
TOKEN = "fault-admin-token"


def _put(http_port: int, keys: np.ndarray) -> None:
    r = httpx.put(f"http://127.0.0.1:{http_port}/v1/models/m/tables/item/embeddings",
                  json={"keys": keys.tolist(), "vectors": rows_for(keys, 1, DIM).tolist(), "version": 1},
                  headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text


def test_redis_cluster_down_at_start(redis_cluster_clean, tmp_path: Path) -> None:
    cluster = redis_cluster_clean
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN},
        "cache": {"enabled": False},
        "volatile": {"type": "redis_cluster", "nodes": cluster.nodes, "partitions": 8,
                     "socket_timeout_s": 0.3, "node_retry_after_s": 0.3},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM}]}],
    })
    keys = np.arange(1, 501, dtype=np.int64)
    for i in range(len(cluster.ports)):
        cluster.kill(i)
    srv = ServerProcess(cfg, grpc_port)
    try:
        srv.start(timeout=60)  # SERVING: a shared Redis down must not take every replica out of the Service
        status, body = readyz(http_port)
        assert status == 200 and any("volatile tier is unreachable" in r for r in body["degraded"]), body
        stats = httpx.get(f"http://127.0.0.1:{http_port}/v1/stats", timeout=10)
        assert stats.status_code == 200 and stats.json()["models"]["m"]["tables"]["item"]["volatile"]["connected"] == 0
        _put(http_port, keys)  # durable in RocksDB; the absent volatile tier writes nothing
        with HPSClient(srv.target) as client:
            answer = client.lookup_with_sources("m", "item", keys)
            assert np.array_equal(answer.vectors, rows_for(keys, 1, DIM))
            assert set(answer.sources.tolist()) == {Source.PERSISTENT}
            time.sleep(1.0)
            assert srv.proc is not None and srv.proc.poll() is None, "the server must not exit"
            cluster.restart_all()
            wait_for(lambda: "degraded" not in readyz(http_port)[1], 30, "/readyz not degraded once Redis is back")
            client.lookup("m", "item", keys)  # read from RocksDB and promoted into the now-connected tier
            # (a gRPC worker hands the rows it read to the owner, which writes them into L2 a moment later)
            wait_for(lambda: set(client.lookup_with_sources("m", "item", keys).sources.tolist()) == {Source.VOLATILE},
                     10, "the rows promoted into Redis")
            again = client.lookup_with_sources("m", "item", keys)
            assert np.array_equal(again.vectors, rows_for(keys, 1, DIM))
        assert srv.stop() == 0
    finally:
        srv.stop()
        cluster.restart_all()
    assert srv.proc is not None
    log = srv.log()
    assert "starting degraded" in log and "volatile" in log


def test_broker_unreachable_at_start(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    dead_broker = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "grace_period_s": 5},
        "cache": {"backend": "numpy", "capacity": 1000},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "updates": {"type": "kafka", "brokers": dead_broker, "group": "g"},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM}]}],
    })
    keys = np.arange(1, 101, dtype=np.int64)
    tier = RocksDBTier(tmp_path / "db")  # rows stored before: the server serves them while the broker is away
    tier.create_table("m.item", DIM)
    tier.put("m.item", keys, rows_for(keys, 1, DIM), np.ones(keys.shape[0], dtype=np.int64))
    tier.close()
    srv = ServerProcess(cfg, grpc_port)
    try:
        srv.start(timeout=60, serving=False)  # up, but not ready: it cannot know whether it has caught up
        time.sleep(2.0)
        status, body = readyz(http_port)
        assert status == 503 and any("update consumer" in r for r in body["not_ready"]), body
        with grpc.insecure_channel(srv.target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with HPSClient(srv.target) as client:
            assert np.array_equal(client.lookup("m", "item", keys), rows_for(keys, 1, DIM))
        assert srv.proc is not None and srv.proc.poll() is None, "the server must not exit"
        t0 = time.monotonic()
        assert srv.stop() == 0
        print(f"\nbroker unreachable at start: /readyz {status} {body['not_ready']}; "
              f"SIGTERM -> exit 0 in {time.monotonic() - t0:.2f} s")
    finally:
        srv.stop()
    log = srv.log()
    assert "cannot reach Kafka" in log
