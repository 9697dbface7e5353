"""``hps serve`` with ``server.workers: 2``: two gRPC worker processes share the port and the owner's store.

Each test starts the server as a user would and talks to it over gRPC and REST. Which worker answers a call is
the kernel's choice (SO_REUSEPORT spreads connections); the tests open channels until both workers have answered
(``/v1/stats`` counts requests per worker).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hps_service.admin.importer import synthesize_model
from hps_service.client import HPSClient
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.helpers import ServerProcess, free_port, run_hps, write_config

SERVING = health_pb2.HealthCheckResponse.SERVING
TOKEN = "node-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIM, ROWS = 16, 20_000


class Node:
    """A running ``hps serve`` with workers, its ports and REST client."""

    def __init__(self, srv: ServerProcess, http_port: int) -> None:
        self.srv = srv
        self.target = srv.target
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30)

    def node_stats(self) -> dict:
        return self.http.get("/v1/stats").json()["node"]

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.node_stats()["workers"]]

    def requests_by_worker(self) -> list[int]:
        return [w["requests"] for w in self.node_stats()["workers"]]

    def channels_to_each_worker(self) -> list[HPSClient]:
        """One client per worker: new connections until each worker has answered one (the kernel picks)."""
        found: dict[int, HPSClient] = {}
        spare = []
        for _ in range(40):
            client = own_connection(self.target)
            before = self.requests_by_worker()
            client.lookup("m", "item", [1])
            after = self.requests_by_worker()
            worker = next(i for i, (a, b) in enumerate(zip(before, after)) if b > a)
            if worker in found:
                spare.append(client)
            else:
                found[worker] = client
            if len(found) == len(after):
                break
        for client in spare:
            client.close()
        assert len(found) == len(self.requests_by_worker()), "the kernel never sent a connection to some worker"
        return [found[i] for i in sorted(found)]


def own_connection(target: str) -> HPSClient:
    """A client with a connection of its own (not shared with the other channels of this process) and the most
    retries the client allows: when a worker is SIGKILLed, its calls in flight fail and so may reconnections the
    kernel hands its listener in the tens of milliseconds before that closes; retries spread over a few hundred
    milliseconds reach a live worker."""
    return HPSClient(target, retries=4, options=[("grpc.use_local_subchannel_pool", 1)])


def assert_metrics_match_node_stats(n: Node) -> None:
    """/metrics sums what each worker reports in /v1/stats: its secondary's memory and the admission rows it dropped
    (a full queue to the owner drops them; a later miss offers them again). Read once the figures are still: a
    worker writes them once a second and no call is running."""
    time.sleep(1.5)
    workers = n.node_stats()["workers"]
    metrics = n.http.get("/metrics").text

    def metric(line_start: str) -> float:
        return float(next(line for line in metrics.splitlines() if line.startswith(line_start)).split()[-1])

    assert metric("hps_node_admissions_dropped_total ") == sum(w["admissions_dropped"] for w in workers)
    assert metric('hps_node_worker_rocksdb_bytes{kind="memtables"}') == sum(w["memtable_bytes"] for w in workers)
    assert metric('hps_node_worker_rocksdb_bytes{kind="block_cache"}') == sum(w["block_cache_bytes"] for w in workers)


def start_node(tmp_path: Path, workers: int = 2, rows: int = ROWS, dim: int = DIM, **sections: dict
               ) -> tuple[Node, np.ndarray, np.ndarray]:
    keys, vectors = synthesize_model(rows, dim, seed=3)
    db = tmp_path / "db"
    tier = RocksDBTier(db, block_cache_mb=8)
    tier.create_table("m.item", dim)
    tier.bulk_import("m.item", keys, vectors, version=1)
    tier.close()
    grpc_port, http_port = free_port(), free_port()
    config = {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": workers,
                   "grace_period_s": 5},
        "cache": {"enabled": True, "backend": "numpy", "capacity": 4096, "admit_after_misses": 1},
        "volatile": {"type": "hashmap", "capacity_rows": 100_000},
        "persistent": {"type": "rocksdb", "path": str(db), "block_cache_mb": 8},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": dim}]}],
    }
    for section, values in sections.items():  # a section naming its type is another backend's: replaced whole
        config[section] = dict(values) if "type" in values else {**config.get(section, {}), **values}
    srv = ServerProcess(write_config(tmp_path / "node.yaml", config), grpc_port).start(timeout=120)
    return Node(srv, http_port), keys, vectors


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Node, np.ndarray, np.ndarray]]:
    n, keys, vectors = start_node(tmp_path)
    try:
        yield n, keys, vectors
    finally:
        n.srv.stop()
        n.http.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_killed_under_load_fails_no_lookup(node: tuple[Node, np.ndarray, np.ndarray]) -> None:
    n, keys, vectors = node
    clients = n.channels_to_each_worker()
    errors: list[BaseException] = []
    calls = [0] * 4
    stop = threading.Event()

    def load(i: int) -> None:
        client = clients[i % len(clients)] if i < len(clients) else own_connection(n.target)
        rng = np.random.default_rng(i)
        while not stop.is_set():
            idx = rng.integers(0, keys.shape[0], 256)
            try:
                np.testing.assert_array_equal(client.lookup("m", "item", keys[idx], timeout=30), vectors[idx])
            except BaseException as exc:  # noqa: BLE001 - every failure is counted, none may happen
                errors.append(exc)
                return
            calls[i] += 1

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    victim = n.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    time.sleep(2.5)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert all(c > 0 for c in calls), calls
    deadline = time.monotonic() + 30
    while (stats := n.node_stats())["workers"][0]["state"] != "ready" or stats["restarts"] < 1:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert not _alive(victim) and stats["workers"][0]["pid"] != victim and stats["workers"][0]["starts"] == 2
    restarted = clients[0]
    idx = np.arange(100)
    np.testing.assert_array_equal(restarted.lookup("m", "item", keys[idx]), vectors[idx])
    for client in clients:
        client.close()


def _lookup_totals(n: Node) -> tuple[list[int], int, float]:
    """(requests per worker, keys looked up in L1 by anyone, Lookup requests in /metrics)."""
    cache = n.http.get("/v1/stats").json()["models"]["m"]["tables"]["item"]["cache"]
    metrics = n.http.get("/metrics").text
    lookups = sum(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith('hps_lookup_requests_total{method="Lookup"'))
    return n.requests_by_worker(), cache["hits"] + cache["misses"], lookups


def test_an_update_applied_by_the_owner_is_served_by_every_worker_at_once(
        node: tuple[Node, np.ndarray, np.ndarray]) -> None:
    """REST writes go through the owner; the next lookup on either worker answers the new row (read your write:
    nothing to wait for, the row is in the shared store when the PUT returns). /v1/stats and /metrics count what
    both workers served."""
    n, keys, vectors = node
    per_worker = n.channels_to_each_worker()
    w = len(per_worker)
    before = _lookup_totals(n)
    sample = keys[:64]
    for version, value in ((2, 7.0), (3, -1.5)):
        rows = np.full((64, DIM), value, np.float32)
        r = n.http.put("/v1/models/m/tables/item/embeddings", headers=AUTH,
                       json={"keys": sample.tolist(), "vectors": rows.tolist(), "version": version})
        assert r.status_code == 200, r.text
        for client in per_worker:
            np.testing.assert_array_equal(client.lookup("m", "item", sample), rows)
    r = n.http.request("DELETE", "/v1/models/m/tables/item/embeddings", headers=AUTH, json={"keys": [int(keys[0])]})
    assert r.status_code == 200
    for client in per_worker:
        got = client.lookup_with_sources("m", "item", keys[:2])
        assert got.sources[0] == 4 and (got.vectors[0] == 0).all()
        np.testing.assert_array_equal(got.vectors[1], np.full(DIM, -1.5, np.float32))
    after = _lookup_totals(n)
    assert [b - a for a, b in zip(before[0], after[0])] == [3] * w  # each worker served its client's 3 calls
    assert after[1] - before[1] == w * (2 * 64 + 2)  # every key counted once, whichever worker looked it up
    assert after[2] - before[2] == 3 * w
    for client in per_worker:
        client.close()


def test_sigterm_drains_every_worker_and_the_owner_s_death_ends_them(tmp_path: Path) -> None:
    n, keys, vectors = start_node(tmp_path / "a", rows=1000)
    try:
        pids = n.worker_pids()
        store = Path(n.node_stats()["store"])
        assert store.exists() and all(_alive(p) for p in pids)
        # another server started on the same gRPC port by mistake is refused (SO_REUSEPORT would have let it share)
        port = int(n.target.rsplit(":", 1)[1])
        second = write_config(tmp_path / "second.yaml", {
            "server": {"grpc_port": port, "http_port": free_port(), "workers": 2},
            "persistent": {"type": "disabled"}, "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM}]}]})
        refused = run_hps("serve", "--config", str(second), timeout=60)
        assert refused.returncode != 0 and "cannot bind gRPC" in refused.stdout + refused.stderr, refused.stderr[-2000:]
        assert n.srv.stop() == 0
        assert not any(_alive(p) for p in pids) and not store.exists()
    finally:
        n.srv.stop()
        n.http.close()
    n, keys, vectors = start_node(tmp_path / "b", rows=1000)
    try:
        pids = n.worker_pids()
        assert n.srv.proc is not None
        with grpc.insecure_channel(n.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING
            n.srv.proc.send_signal(signal.SIGKILL)
            n.srv.proc.wait(10)
            answers = []  # what a probe hears while the workers outlive their owner: never SERVING
            deadline = time.monotonic() + 15
            while any(_alive(p) for p in pids):
                assert time.monotonic() < deadline, "workers outlived their owner"
                try:
                    answers.append(health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status)
                except grpc.RpcError:
                    time.sleep(0.005)
        assert SERVING not in answers, answers
    finally:
        n.srv.stop()
        n.http.close()


def test_rows_only_in_rocksdb_are_read_fresh_by_the_workers(tmp_path: Path) -> None:
    """No volatile tier: a worker's misses read its RocksDB secondary instance, which catches up before reading a
    key the owner wrote since (a deleted row is never served, an updated one never older, not even after a
    snapshot flushed the memtables)."""
    n, keys, vectors = start_node(tmp_path, volatile={"type": "disabled"}, cache={"capacity": 64})
    try:
        per_worker = n.channels_to_each_worker()
        for w, client in enumerate(per_worker):
            lo = 5000 + 10 * w
            cold = keys[lo:lo + 4]  # never asked before (so not in L1), and other keys for each worker
            r = n.http.request("DELETE", "/v1/models/m/tables/item/embeddings", headers=AUTH,
                               json={"keys": [int(cold[0])]})
            assert r.status_code == 200
            rows = np.full((1, DIM), 3.25 + w, np.float32)
            r = n.http.put("/v1/models/m/tables/item/embeddings", headers=AUTH,
                           json={"keys": [int(cold[1])], "vectors": rows.tolist(), "version": 5})
            assert r.status_code == 200
            got = client.lookup_with_sources("m", "item", cold)
            assert got.sources.tolist() == [4, 3, 3, 3]
            np.testing.assert_array_equal(got.vectors[1], rows[0])
            np.testing.assert_array_equal(got.vectors[2:], vectors[lo + 2:lo + 4])
        # A snapshot (a checkpoint flushes every memtable) between a write and the workers' next read, each
        # worker's secondary holding the row before it (issue 27, defect 1: RocksDB 10.4's secondary kept it).
        probe = keys[8000:8256]  # four times what L1 holds: most are read from RocksDB
        for version in (7, 8):
            rows = np.full((probe.shape[0], DIM), version, np.float32)
            r = n.http.put("/v1/models/m/tables/item/embeddings", headers=AUTH,
                           json={"keys": probe.tolist(), "vectors": rows.tolist(), "version": version})
            assert r.status_code == 200
            if version == 7:
                for client in per_worker:
                    assert (client.lookup("m", "item", probe) == 7).all()
        assert n.http.post("/v1/models/m/snapshots", headers=AUTH).status_code == 201
        for _ in range(3):
            for client in per_worker:
                got = client.lookup_with_sources("m", "item", probe)
                assert (got.sources == 3).any()
                assert (got.vectors == 8).all(), f"{int((got.vectors[:, 0] != 8).sum())} rows from before the flush"
        for client in per_worker:
            client.close()
        # each worker reports its secondary's memory: the WAL it replayed (memtables) and the blocks it read
        deadline = time.monotonic() + 10
        while not all(w["memtable_bytes"] > 0 and w["block_cache_bytes"] > 0 for w in n.node_stats()["workers"]):
            assert time.monotonic() < deadline, n.node_stats()["workers"]
            time.sleep(0.2)
        assert_metrics_match_node_stats(n)
    finally:
        n.srv.stop()
        n.http.close()


def test_a_large_batch_read_from_rocksdb_is_promoted_whole(tmp_path: Path) -> None:
    """8000 rows of dim 256 (8 MB) found in RocksDB by one call: the worker hands them to the owner in records its
    queue takes (one record of them all is more than half the queue, which refuses it: no row would ever be
    promoted), and the owner writes every one into the hash map."""
    # more rows stored than the hash map holds: it is not preloaded at start, rows enter it only when promoted
    n, keys, vectors = start_node(tmp_path, rows=16_000, dim=256, cache={"enabled": False},
                                  volatile={"capacity_rows": 12_000})
    keys, vectors = keys[:8000], vectors[:8000]
    try:
        with HPSClient(n.target) as client:
            first = client.lookup_with_sources("m", "item", keys)
            assert (first.sources == 3).all()
            np.testing.assert_array_equal(first.vectors, vectors)
            deadline = time.monotonic() + 30
            while not ((again := client.lookup_with_sources("m", "item", keys)).sources == 2).all():
                assert time.monotonic() < deadline, f"not promoted: {np.bincount(again.sources).tolist()}"
                time.sleep(0.2)
            np.testing.assert_array_equal(again.vectors, vectors)
        assert_metrics_match_node_stats(n)
    finally:
        n.srv.stop()
        n.http.close()
