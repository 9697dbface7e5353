"""`hps serve` with updates.type kafka against a real tansu broker: ready after assignment, fresh rows served."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np

from hps_service.client import HPSClient
from hps_service.errors import NotFoundError
from hps_service.updates import Publisher, make_version
from tests.helpers import ServerProcess, free_port, write_config

DIM = 16


def wait_ready(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        r = httpx.get(url, timeout=2)
        last = r.json()
        if r.status_code == 200:
            return last
        time.sleep(0.1)
    raise TimeoutError(f"not ready: {last}")


def test_published_rows_are_served_fresh(kafka_broker, tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port},
        "cache": {"backend": "numpy", "capacity": 1000},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "updates": {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": "e2e", "group": "pod-0"},
        "models": [{"name": "live", "tables": [{"name": "item", "dim": DIM}]}],
    })
    keys = np.arange(1, 2001, dtype=np.int64)
    publisher = Publisher(kafka_broker.bootstrap, "live", topic_prefix="e2e")
    with ServerProcess(cfg, grpc_port) as srv, HPSClient(srv.target) as client:
        wait_ready(f"http://127.0.0.1:{http_port}/readyz")
        assert set(client.lookup_with_sources("live", "item", keys[:10]).sources) == {4}  # nothing yet: defaults
        lags = []
        for step in range(1, 4):
            rows = np.full((keys.size, DIM), step, dtype=np.float32) + keys[:, None].astype(np.float32) / 1e4
            sent = time.monotonic()
            publisher.publish("item", keys, rows, make_version(0, step))
            publisher.flush(10)
            deadline = sent + 30
            while time.monotonic() < deadline:
                got = client.lookup("live", "item", keys)
                if np.array_equal(got, rows):
                    lags.append(time.monotonic() - sent)
                    break
                # never an older step than the one before this publish
                assert got.min() >= step - 1
                time.sleep(0.01)
            else:
                raise AssertionError(f"step {step} not served within 30 s")
        publisher.delete("item", keys[:5], make_version(0, 4))
        publisher.flush(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if set(client.lookup_with_sources("live", "item", keys[:5]).sources) == {4}:
                break
            time.sleep(0.02)
        else:
            raise AssertionError("deleted rows still served")
        stats = httpx.get(f"http://127.0.0.1:{http_port}/v1/stats", timeout=5).json()
        assert stats["updates"]["rows_applied"] >= 3 * keys.size
        assert srv.stop() == 0
    publisher.close()


def _lookup_once_loaded(client: HPSClient, model: str, keys: np.ndarray) -> np.ndarray | None:
    """The rows, or None while the worker process that took the call has not yet loaded the model the owner
    registered (a worker learns of it from the node's store a moment after the REST call returned)."""
    try:
        return client.lookup(model, "item", keys)
    except NotFoundError:
        return None


def test_model_registered_over_rest_receives_its_updates(kafka_broker, tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    token = "t0ken-for-e2e"
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": token},
        "cache": {"backend": "numpy", "capacity": 1000},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "updates": {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": "e2e", "group": "pod-1"},
        "models": [{"name": "first", "tables": [{"name": "item", "dim": DIM}]}],
    })
    base, auth = f"http://127.0.0.1:{http_port}", {"Authorization": f"Bearer {token}"}
    keys = np.arange(1, 301, dtype=np.int64)
    rows = np.random.default_rng(3).random((keys.size, DIM), dtype=np.float32)
    publisher = Publisher(kafka_broker.bootstrap, "late", topic_prefix="e2e")
    with ServerProcess(cfg, grpc_port) as srv, HPSClient(srv.target) as client:
        wait_ready(f"{base}/readyz")
        body = {"name": "late", "tables": [{"name": "item", "dim": DIM}]}
        assert httpx.post(f"{base}/v1/models", json=body, headers=auth, timeout=10).status_code == 201
        publisher.publish("item", keys, rows, make_version(0, 1))
        publisher.flush(10)
        deadline = time.monotonic() + 30
        while not np.array_equal(_lookup_once_loaded(client, "late", keys), rows):
            assert time.monotonic() < deadline, "updates of a model registered at runtime were not applied"
            time.sleep(0.05)
        assert "e2e.late" in httpx.get(f"{base}/v1/stats", timeout=5).json()["updates"]["topics"]
        assert httpx.delete(f"{base}/v1/models/late", headers=auth, timeout=10).status_code == 200
        deadline = time.monotonic() + 30
        while "e2e.late" in httpx.get(f"{base}/v1/stats", timeout=5).json()["updates"]["topics"]:
            assert time.monotonic() < deadline, "the unloaded model's topic is still consumed"
            time.sleep(0.05)
        assert srv.stop() == 0
    publisher.close()
