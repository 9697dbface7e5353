"""A node's lifecycle edges as a user drives them, against ``hps serve`` with gRPC workers and a colocated store: a
version dropped and added again, a model replaced or a table converted while writes go on, and a worker that dies
as soon as it starts. No reader (a worker, ``LocalClient``, the owner's REST) answers a row older than one already
acknowledged, and ``/readyz`` says ready only while every worker serves."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_service.client import HPSClient
from hps_service.local import LocalClient
from tests.helpers import ServerProcess, free_port, write_config

TOKEN = "lifecycle-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIM = 4
KEYS = np.arange(1, 65, dtype=np.int64)


class Node:
    """``hps serve`` with workers and a colocated store; its REST client."""

    def __init__(self, tmp: Path, workers: int = 1) -> None:
        self.store = Path(tempfile.mkdtemp(prefix="hps-life-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        grpc_port, http_port = free_port(), free_port()
        self.config = {
            "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": workers,
                       "grace_period_s": 5, "local": {"enabled": True, "path": str(self.store)}},
            "cache": {"backend": "numpy", "capacity": 2048, "admit_after_misses": 1},
            "volatile": {"type": "hashmap", "capacity_rows": 50_000},
            "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
            "models": [{"name": "m", "keep_versions": 3, "tables": [{"name": "item", "dim": DIM}]}],
        }
        self.srv = ServerProcess(write_config(tmp / "hps.yaml", self.config), grpc_port).start(timeout=120)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60, headers=AUTH)
        self.client = HPSClient(self.srv.target, retries=4)

    def put(self, value: float, version: int = 0, keys: np.ndarray = KEYS) -> None:
        """Put ``value`` in every column of ``keys`` (acknowledged once this returns)."""
        body = {"keys": keys.tolist(), "vectors": np.full((keys.shape[0], DIM), value).tolist(),
                "version": time.time_ns() // 1000}
        r = self.http.put("/v1/models/m/tables/item/embeddings", params={"model_version": version}, json=body)
        assert r.status_code == 200, r.text

    def rest_rows(self, version: int) -> np.ndarray:
        r = self.http.get("/v1/models/m/tables/item/embeddings",
                          params={"keys": ",".join(map(str, KEYS.tolist())), "model_version": version})
        assert r.status_code == 200, r.text
        return np.asarray(r.json()["vectors"], dtype=np.float32)

    def node_stats(self) -> dict:
        return self.http.get("/v1/stats").json()["node"]

    def close(self) -> None:
        self.client.close()
        self.http.close()
        self.srv.stop()
        shutil.rmtree(self.store, ignore_errors=True)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.close()


def test_a_version_dropped_and_added_again_answers_only_its_new_rows_everywhere(node: Node) -> None:
    """The re-added version's tables are new tables (new tier ids, new arrays): the worker, ``LocalClient`` and the
    owner answer what was put after the re-add, never the dropped version's rows, and no worker dies reading them."""
    assert node.http.post("/v1/models/m/versions", json={"version": 2}).status_code == 201
    node.put(1.0, version=2)
    assert (node.client.lookup("m", "item", KEYS, version=2) == 1.0).all()  # the worker mapped the first table
    with LocalClient(node.store, timeout=10) as local:
        assert (local.lookup("m", "item", KEYS, version=2) == 1.0).all()
        assert node.http.delete("/v1/models/m/versions/2").status_code == 200
        assert node.http.post("/v1/models/m/versions", json={"version": 2}).status_code == 201
        assert (node.rest_rows(2) == 0.0).all(), "the re-added version holds the dropped one's rows"
        node.put(2.0, version=2)
        assert node.http.post("/v1/models/m/versions", json={"version": 3}).status_code == 201
        for _ in range(3):  # the worker's L1 misses go to the hash map, then its admissions reach L1
            assert (node.client.lookup("m", "item", KEYS, version=2) == 2.0).all()
            assert (local.lookup("m", "item", KEYS, version=2) == 2.0).all()
            time.sleep(0.05)
    assert (node.rest_rows(2) == 2.0).all()
    stats = node.node_stats()
    assert stats["restarts"] == 0 and not stats["given_up"], stats
    assert node.http.get("/readyz").status_code == 200


def test_writes_during_a_model_replace_are_read_by_every_worker_once_acknowledged(tmp_path: Path) -> None:
    """``POST /v1/models?replace=true`` moves writes to new tables only once the workers serve them: a row put
    while a replace runs is answered by every worker as soon as its put returns."""
    n = Node(tmp_path, workers=2)
    stale: list[str] = []
    stop = threading.Event()
    try:
        n.put(1.0)

        def write_then_read() -> None:
            value = 1.0
            clients = [HPSClient(n.srv.target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
            try:
                while not stop.is_set():
                    value += 1.0
                    n.put(value)
                    for c in clients:
                        got = c.lookup("m", "item", KEYS)
                        if (got < value).any():
                            stale.append(f"{float(got.min())} after the put of {value} was acknowledged")
            finally:
                for c in clients:
                    c.close()

        writer = threading.Thread(target=write_then_read)
        writer.start()
        model = n.config["models"][0]
        for _ in range(10):
            r = n.http.post("/v1/models", params={"replace": "true"}, json=model)
            assert r.status_code == 201, r.text
        stop.set()
        writer.join(60)
        assert not stale, stale[:5]
    finally:
        stop.set()
        n.close()


def test_a_write_waiting_on_a_replaced_table_reaches_it_only_once_every_worker_serves_it(tmp_path: Path) -> None:
    """The owner holds the new tables' write locks until every worker serves them: a write that waited for the lock
    during a replace (or a conversion's switch, which registers the model again) finds the manifest that names the
    new table published and read by every worker, so no worker can go on answering from the old table's L1."""
    import json

    from hps_service.node.store.layout import H_MANIFEST, MANIFEST
    from hps_service.node.store.node_store import W_MANIFEST
    from tests.server.conftest import running, server_config

    config = server_config(tmp_path, workers=2)
    with running(config) as srv:
        engine, node = srv.engine, srv.node
        assert engine is not None and node is not None
        model = engine.model("demo")
        seen: list[str] = []

        def write() -> None:
            with engine.writing("demo", "item") as t:
                published = int(node.store.header[H_MANIFEST])
                serial = json.loads((node.store.path / MANIFEST).read_text())["served"]["demo"]["item"]
                served = node.store.workers[:2, W_MANIFEST].tolist()
                if engine.served_table(serial) is not t or min(served) < published:
                    seen.append(f"manifest {published} names serial {serial}, workers serve {served}")

        guard = engine.table("demo", "item").guard.lock
        for _ in range(10):
            replace = threading.Thread(target=engine.register_model, args=(model,))
            replace.start()
            while not guard.locked():  # the replace holds the table's write lock: the write queues behind it
                time.sleep(0.0005)
            writer = threading.Thread(target=write)
            writer.start()
            replace.join(30)
            writer.join(30)
        assert not seen, f"writes reached a new table before every worker served it: {seen}"


def test_a_worker_that_dies_as_it_starts_is_given_up_and_the_node_is_not_ready(tmp_path: Path) -> None:
    """A worker killed each time right after it starts is restarted with a growing back-off, then not at all; the
    node says not ready from the first death on, naming the worker, and the metrics count it failed."""
    n = Node(tmp_path)
    try:
        assert n.http.get("/readyz").status_code == 200
        killed: set[int] = set()
        deadline = time.monotonic() + 60
        while not (stats := n.node_stats()).get("given_up"):
            assert time.monotonic() < deadline, stats
            pid = stats["workers"][0]["pid"]
            if pid not in killed and stats["workers"][0]["state"] in ("starting", "ready"):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                time.sleep(0.1)
                ready = n.http.get("/readyz")
                assert ready.status_code == 503 and "gRPC worker 0" in ready.text, ready.text
            time.sleep(0.02)
        assert len(killed) == 5 and "crash-loops" in stats["given_up"][0], stats
        time.sleep(1.0)
        assert n.node_stats()["workers"][0]["pid"] in killed, "a worker given up was started again"
        ready = n.http.get("/readyz")
        assert ready.status_code == 503 and "crash-loops" in ready.text and "restart the server" in ready.text
        assert 'hps_node_workers{state="failed"} 1.0' in n.http.get("/metrics").text
    finally:
        n.close()


def test_a_worker_loading_a_manifest_whose_table_is_freed_meanwhile_loads_the_newer_one(tmp_path: Path) -> None:
    """A worker maps the tables of the manifest it read; a replace that publishes a newer manifest and frees the old
    table between the two makes that mapping fail (its files are gone). The worker loads the newer manifest instead
    of failing the lookup that synced (the INTERNAL reads a long lifecycle history run found)."""
    from hps_service.node.store.view import StoreView
    from hps_service.node.worker_engine import WorkerEngine
    from tests.server.conftest import running, server_config

    config = server_config(tmp_path, workers=1, local={"enabled": True, "path": str(tmp_path / "store")})
    with running(config) as srv:
        engine, node = srv.engine, srv.node
        assert engine is not None and node is not None
        dim = engine.model("demo").tables[0].dim
        engine.apply_updates("demo", "item", np.array([7], dtype=np.int64), np.full((1, dim), 3.0, np.float32), 1)
        view = StoreView(node.store.path, writable=True)
        reader = WorkerEngine(config, view, worker=0)  # a second reader in worker 0's place (its L1 stamps, its row)
        model = engine.model("demo")
        replaced: list[int] = []
        table = view.table

        def table_replaced_meanwhile(serial: int):  # type: ignore[no-untyped-def]
            if not replaced:  # the first table of the manifest being loaded: a replace supersedes it and frees it
                replaced.append(serial)
                engine.register_model(model)
            return table(serial)

        engine.register_model(model)  # a newer manifest for the reader to load
        view.table = table_replaced_meanwhile  # type: ignore[method-assign]
        reader.sync()
        assert replaced, "the reader did not load the replaced manifest"
        got = reader.lookup("demo", "item", np.array([7, 8], dtype=np.int64))
        assert got.vectors.tolist() == [[3.0] * dim, [0.0] * dim]
