"""The admin token never reaches the logs or any response; Kafka security settings (updates.kafka_config) and
Redis AUTH user / TLS (volatile.username, tls, ca_file) reach the real clients."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from hps_service.client import HPSClient
from hps_service.config import RedisClusterVolatile, UpdatesConfig, load_config
from hps_service.serve.process import HPSServer
from hps_service.tiers.deferred import DeferredTier
from hps_service.tiers.redis import RedisClusterTier
from hps_service.tiers.registry import build_volatile
from hps_service.updates import Publisher
from tests.faults.support import readyz, wait_for
from tests.helpers import HPS, REPO, free_port, wait_serving, write_config
from tests.security.certs import PKI, make_pki

TOKEN = "s3cr3t-admin-token-3f9a1c"
WRONG = "wr0ng-guess-token-77b2e0"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_admin_token_never_logged_or_returned(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "max_body_bytes": 4096},
        "cache": {"backend": "numpy", "capacity": 128},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 2}]}],
    })
    proc = subprocess.Popen([*HPS, "serve", "--config", str(cfg), "--log-level", "debug"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    bodies = []
    try:
        wait_serving(f"127.0.0.1:{grpc_port}", 60, proc)
        base = f"http://127.0.0.1:{http_port}"
        rows = f"{base}/v1/models/demo/tables/item/embeddings"
        good, bad = {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": f"Bearer {WRONG}"}
        with httpx.Client(timeout=10) as http:
            checks = [
                (http.put(rows, json={"keys": [1], "vectors": [[1, 2]]}, headers=good), 200),
                (http.put(rows, json={"keys": [1], "vectors": [[1, 2]]}), 401),
                (http.put(rows, json={"keys": [1], "vectors": [[1, 2]]}, headers=bad), 403),
                (http.put(rows, json={"keys": [1], "vectors": [[1, 2]]}, headers={"Authorization": f"Basic {TOKEN}"}),
                 401),
                (http.put(rows, content=b"{not json", headers={**good, "Content-Type": "application/json"}), 422),
                (http.put(rows, json={"keys": [1], "vectors": [[1, 2, 3]]}, headers=good), 400),
                (http.put(rows, content=b"x" * 10_000, headers=good), 413),
                (http.delete(f"{base}/v1/models/nope", headers=good), 404),
                (http.post(f"{base}/v1/models/demo/tables/item/import", json={"path": "/nonexistent"}, headers=good),
                 400),
            ]
            for response, status in checks:
                assert response.status_code == status, (response.request.url, response.text)
                bodies.append(response.text)
            for path in ("/v1/stats", "/v1/models", "/openapi.json", "/metrics", "/readyz"):
                bodies.append(http.get(base + path).text)
        with HPSClient(f"127.0.0.1:{grpc_port}") as client:
            assert client.lookup("demo", "item", [1]).tolist() == [[1.0, 2.0]]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "DEBUG" in out or "debug" in out.lower() or len(out) > 100, "expected a verbose log to search"
    for secret in (TOKEN, WRONG):
        assert secret not in out, f"a token appears in the server log:\n{out}"
        assert not any(secret in b for b in bodies), "a token appears in a response"


def test_kafka_security_settings_reach_the_clients(kafka_broker, pki: PKI, tmp_path: Path) -> None:
    def server(kafka_config: dict, name: str) -> HPSServer:
        config = load_config(
            None,
            server={"grpc_port": free_port(), "http_port": 0, "grpc_workers": 2, "grace_period_s": 3},
            cache={"enabled": False},
            persistent={"type": "rocksdb", "path": str(tmp_path / name), "block_cache_mb": 8},
            updates={"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": "sec", "group": name,
                     "kafka_config": kafka_config},
            models=[{"name": "secm", "tables": [{"name": "item", "dim": 2}]}],
        )
        srv = HPSServer(config)
        srv.start()
        return srv

    tls_to_plaintext = {"security.protocol": "SSL", "ssl.ca.location": str(pki.ca)}
    srv = server(tls_to_plaintext, "ssl")
    try:
        time.sleep(2.0)
        status, body = readyz(srv.http_port)  # type: ignore[arg-type]
        assert status == 503 and any("update consumer" in r for r in body["not_ready"]), body
        assert srv.consumer is not None and not srv.consumer.ready
    finally:
        srv.stop(grace=3)
    srv = server({"security.protocol": "PLAINTEXT", "client.id": "hps-sec-test"}, "plain")
    try:
        wait_for(lambda: readyz(srv.http_port)[0] == 200, 30, "ready with PLAINTEXT")  # type: ignore[arg-type]
    finally:
        srv.stop(grace=3)
    with pytest.raises(Exception, match="(?i)timed out|transport|ssl|handshake|broker"):
        Publisher(kafka_broker.bootstrap, "secm", topic_prefix="sec", metadata_timeout_s=2, **tls_to_plaintext)
    assert UpdatesConfig(kafka_config={"sasl.mechanism": "PLAIN", "sasl.username": "u"}).kafka_config


@pytest.fixture
def secure_redis(pki: PKI, tmp_path: Path) -> Iterator[int]:
    """A one-node Redis Cluster that speaks only TLS and needs AUTH (ACL user ``hps``); yields its TLS port."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server must be on PATH (make test-deps installs it)")
    port = free_port(pair=True)
    proc = subprocess.Popen([
        "redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key),
        "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "no", "--tls-cluster", "yes",
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--dir", str(tmp_path),
        "--save", "", "--appendonly", "no", "--requirepass", "default-pw",
        "--user", "hps", "on", ">hps-secret", "~*", "&*", "+@all",
    ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        node = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(pki.ca), username="hps",
                           password="hps-secret", socket_timeout=2)
        wait_for(lambda: _ping(node), 20, "the TLS redis-server to answer")
        node.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_for(lambda: b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO"), 20, "cluster_state:ok")
        node.close()
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def _ping(node: redis.Redis) -> bool:
    try:
        return bool(node.ping())
    except redis.RedisError:
        return False


def test_redis_auth_user_and_tls_from_config(secure_redis: int, pki: PKI) -> None:
    base = {"type": "redis_cluster", "nodes": [f"127.0.0.1:{secure_redis}"], "partitions": 4,
            "socket_timeout_s": 0.5, "node_retry_after_s": 0.5}
    tier = build_volatile(RedisClusterVolatile(**base, username="hps", password="hps-secret", tls=True, ca_file=pki.ca))
    try:
        assert isinstance(tier, RedisClusterTier) and tier.healthy()
        tier.create_table("m.t", 3)
        keys = np.array([1, 2, 3], dtype=np.int64)
        tier.put("m.t", keys, np.ones((3, 3), dtype=np.float32), np.ones(3, dtype=np.int64))
        assert tier.get("m.t", keys).found.all()
    finally:
        assert tier is not None
        tier.close()
    for wrong in ({"username": "hps", "password": "nope", "tls": True, "ca_file": pki.ca},
                  {"username": "hps", "password": "hps-secret", "tls": False}):
        degraded = build_volatile(RedisClusterVolatile(**base, **wrong))
        try:
            assert isinstance(degraded, DeferredTier) and not degraded.healthy()
        finally:
            assert degraded is not None
            degraded.close()
