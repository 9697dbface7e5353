"""Colocated reads: a LocalClient maps the server's store (``server.local``) and answers as gRPC does.

The server is ``hps serve`` with two workers and its store in a memory-backed directory; the client runs in this
process, as an inference process in the server's pod would.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_service.admin.importer import synthesize_model
from hps_service.client import HPSClient
from hps_service.errors import InvalidArgumentError, UnavailableError
from hps_service.local import LocalClient
from hps_service.node.colocated import ColocatedTransport
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.helpers import ServerProcess, free_port, write_config

TOKEN = "local-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIM, ROWS, EXTRA = 16, 20_000, 2_000


@pytest.fixture(scope="module")
def shm() -> Iterator[Path]:
    """A directory on the memory-backed filesystem, as the chart's emptyDir (medium: Memory) is."""
    path = Path(tempfile.mkdtemp(prefix="hps-local-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class LocalServer:
    def __init__(self, workdir: Path, store: Path) -> None:
        self.workdir, self.store = workdir, store
        self.grpc_port, self.http_port = free_port(), free_port()
        config = {
            # the socket elsewhere than <store>/grpc.sock: every LocalClient here learns it from the store
            "server": {"grpc_port": self.grpc_port, "http_port": self.http_port, "admin_token": TOKEN, "workers": 2,
                       "grace_period_s": 5, "local": {"enabled": True, "path": str(store)},
                       "uds_path": str(workdir / f"{store.name}.sock")},
            # L1 smaller than the table (the warm start drops rows once sets fill, so admission then asks for 15
            # recent misses: nothing the test does moves rows into L1), the hash map holds every row
            "cache": {"enabled": True, "backend": "numpy", "capacity": 16384, "admit_after_misses": 15},
            "volatile": {"type": "hashmap", "capacity_rows": 100_000},
            "persistent": {"type": "rocksdb", "path": str(workdir / "db"), "block_cache_mb": 8},
            "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM}]}],
        }
        self.srv = ServerProcess(write_config(workdir / "local.yaml", config), self.grpc_port)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.http_port}", timeout=30)

    def start(self, rows: int) -> LocalServer:
        self.srv.start(timeout=120)
        deadline = time.monotonic() + 120
        while True:  # the hash map preloaded and L1 warmed from RocksDB
            stats = self.http.get("/v1/stats").json()["models"]["m"]["tables"]["item"]
            if stats["volatile"]["rows"] >= rows and stats["cache"]["warm_rows"] > 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        return self

    def put(self, keys: np.ndarray, rows: np.ndarray, version: int) -> None:
        r = self.http.put("/v1/models/m/tables/item/embeddings", headers=AUTH,
                          json={"keys": keys.tolist(), "vectors": rows.tolist(), "version": version})
        assert r.status_code == 200, r.text

    def stop(self) -> int:
        return self.srv.stop()


def _import(db: Path, keys: np.ndarray, vectors: np.ndarray) -> None:
    tier = RocksDBTier(db, block_cache_mb=8)
    tier.create_table("m.item", DIM)
    tier.bulk_import("m.item", keys, vectors, version=1)
    tier.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, shm: Path) -> Iterator[tuple[LocalServer, np.ndarray,
                                                                               np.ndarray]]:
    workdir = tmp_path_factory.mktemp("local")
    keys, vectors = synthesize_model(ROWS + EXTRA, DIM, seed=9)
    _import(workdir / "db", keys[:ROWS], vectors[:ROWS])
    srv = LocalServer(workdir, shm / "store").start(ROWS)
    srv.put(keys[ROWS:], vectors[ROWS:], 1)  # in L2 (and RocksDB), not in L1
    try:
        yield srv, keys, vectors
    finally:
        srv.stop()
        srv.http.close()


def test_local_reads_answer_exactly_as_grpc_sources_included(server: tuple[LocalServer, np.ndarray, np.ndarray]
                                                             ) -> None:
    srv, keys, vectors = server
    rng = np.random.default_rng(3)
    absent = rng.integers(2**40, 2**41, 3000)
    pool = np.concatenate((keys, absent))
    asked = pool[rng.integers(0, pool.shape[0], 100_000)]  # hits in L1 and L2, defaults, duplicates
    seen = np.zeros(5, np.int64)
    with LocalClient(srv.store) as local, HPSClient(srv.srv.target) as remote:
        assert local.mapped
        for batch in np.array_split(asked, 12):
            mine = local.lookup_with_sources("m", "item", batch)
            theirs = remote.lookup_with_sources("m", "item", batch)
            np.testing.assert_array_equal(mine.vectors, theirs.vectors)
            np.testing.assert_array_equal(mine.sources, theirs.sources)
            seen += np.bincount(mine.sources, minlength=5)
        assert local.list_models() == remote.list_models() == {"m": {"item": DIM}}
    with HPSClient(f"local://{srv.store}") as by_target, HPSClient(srv.srv.target) as remote:
        # the client package's way to colocated reads: the transport hps-service registers, picked by the target
        assert isinstance(by_target.transport, ColocatedTransport) and by_target.transport.mapped
        np.testing.assert_array_equal(by_target.lookup("m", "item", asked[:4096]), remote.lookup("m", "item", asked[:4096]))
    assert seen[1] and seen[2] and seen[4] and not seen[3], seen.tolist()
    index = {int(k): i for i, k in enumerate(keys)}
    stored = np.array([int(k) in index for k in asked])
    np.testing.assert_array_equal(asked[stored].shape[0], seen[1] + seen[2])


def test_a_local_client_streams_through_the_owner_in_order(server: tuple[LocalServer, np.ndarray, np.ndarray]
                                                            ) -> None:
    """lookup_stream on a colocated client: the owner answers the stream over the socket, each answer the next one
    asked, with the rows gRPC answers."""
    from hps_client import StreamRequest

    srv, keys, _ = server
    batches = np.array_split(keys[:4000], 8)
    with LocalClient(srv.store) as local, HPSClient(srv.srv.target) as remote:
        answers = list(local.lookup_stream((StreamRequest("m", {"item": b}) for b in batches), max_in_flight=3))
        assert [a.request_id for a in answers] == list(range(1, 9))
        for batch, answer in zip(batches, answers):
            np.testing.assert_array_equal(answer.tables["item"].vectors, remote.lookup("m", "item", batch))


def test_lookup_after_the_first_call_answers_as_grpc(server: tuple[LocalServer, np.ndarray, np.ndarray]) -> None:
    """Once a table is mapped, ``lookup`` reads L1 in one compiled call and hands its hit mask to the general path
    only when a key missed: batches of L1 hits alone, and of L1 and hash-map hits, defaults, duplicates and the int64
    edges, each answered as gRPC answers them, with and without ``out=``."""
    srv, keys, _ = server
    rng = np.random.default_rng(17)
    edges = np.array([-(2**63), 2**63 - 1, 0, -1, 1], np.int64)
    with LocalClient(srv.store) as local, HPSClient(srv.srv.target) as remote:
        local.lookup("m", "item", keys[:8])  # maps the table
        l1_keys = keys[:ROWS][local.lookup_with_sources("m", "item", keys[:ROWS]).sources == 1]
        assert l1_keys.shape[0] > 1000
        for i in range(16):
            if i % 2:
                asked = l1_keys[rng.integers(0, l1_keys.shape[0], 1 + 97 * i)]
            else:
                pool = np.concatenate((keys, edges, rng.integers(2**40, 2**41, 500)))
                asked = np.concatenate((edges[i % 5:][:1], pool[rng.integers(0, pool.shape[0], 131 * i)]))
            want = remote.lookup_with_sources("m", "item", asked)
            assert (want.sources == 1).all() == bool(i % 2)
            out = np.full((asked.shape[0], DIM), np.nan, np.float32) if i % 4 < 2 else None
            got = local.lookup("m", "item", asked, out=out)
            assert out is None or got is out
            np.testing.assert_array_equal(got, want.vectors)
        # keys the one-call read does not take go the general way: none, a strided view, Python ints
        assert local.lookup("m", "item", np.empty(0, np.int64)).shape == (0, DIM)
        strided = l1_keys[:200:2]
        np.testing.assert_array_equal(local.lookup("m", "item", strided), remote.lookup("m", "item", strided))
        listed = [int(k) for k in l1_keys[:50]] + [2**63 - 1]
        np.testing.assert_array_equal(local.lookup("m", "item", listed), remote.lookup("m", "item", listed))


def test_threads_reading_batches_of_one_size_at_once_each_get_their_own_rows(
        server: tuple[LocalServer, np.ndarray, np.ndarray]) -> None:
    """Each thread keeps its own hit mask per batch size: four threads reading batches of one size at once (L1 hits
    alone, and L1 with hash-map hits) each get their own batch's rows, never rows placed by another's mask."""
    srv, keys, _ = server
    rng = np.random.default_rng(23)
    with LocalClient(srv.store) as local, HPSClient(srv.srv.target) as remote:
        local.lookup("m", "item", keys[:8])  # maps the table
        l1_keys = keys[:ROWS][local.lookup_with_sources("m", "item", keys[:ROWS]).sources == 1]
        batches = [l1_keys[rng.integers(0, l1_keys.shape[0], 512)] if b % 2 else
                   np.concatenate((l1_keys[rng.integers(0, l1_keys.shape[0], 384)], keys[ROWS:][:128]))
                   for b in range(8)]
        wants = [remote.lookup("m", "item", batch) for batch in batches]
        failures: list[BaseException] = []

        def read(first: int) -> None:
            try:
                for i in range(400):
                    j = (first + i) % len(batches)
                    np.testing.assert_array_equal(local.lookup("m", "item", batches[j]), wants[j])
            except BaseException as exc:  # noqa: BLE001  (handed to the test's thread)
                failures.append(exc)

        threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[0]


def test_rows_go_into_the_callers_buffer_when_given(server: tuple[LocalServer, np.ndarray, np.ndarray]) -> None:
    """``out=``: L1 and hash-map hits and the server's answers for the rest land in the caller's array, the same
    rows as without it, on both clients; a buffer of the wrong shape, dtype or layout is refused, naming it."""
    srv, keys, _ = server
    rng = np.random.default_rng(11)
    asked = np.concatenate((keys[rng.integers(0, keys.shape[0], 900)], rng.integers(2**40, 2**41, 124)))
    out = np.full((asked.shape[0], DIM), np.nan, np.float32)
    with LocalClient(srv.store) as local, HPSClient(srv.srv.target) as remote:
        want = remote.lookup("m", "item", asked)
        assert local.lookup("m", "item", asked, out=out) is out
        np.testing.assert_array_equal(out, want)
        out.fill(np.nan)
        assert remote.lookup("m", "item", asked, out=out) is out
        np.testing.assert_array_equal(out, want)
        read_only = np.zeros((asked.shape[0], DIM), np.float32)
        read_only.flags.writeable = False
        for bad, why in ((np.empty((asked.shape[0], DIM + 1), np.float32), r"shape \(1024, 16\), got float32"),
                         (np.empty((asked.shape[0], DIM), np.float64), "got float64"),
                         (np.empty((DIM, asked.shape[0]), np.float32).T, "not C-contiguous"),
                         (read_only, "read-only")):
            for client in (local, remote):
                with pytest.raises(InvalidArgumentError, match=why):
                    client.lookup("m", "item", asked, out=bad)
        assert not read_only.any()


def test_no_torn_row_and_every_acknowledged_update_is_read_at_once(server: tuple[LocalServer, np.ndarray, np.ndarray]
                                                                  ) -> None:
    """A writer rewrites cached rows over REST (each row ``key * 1000 + version``); a reader thread checks every row
    it reads is whole, and after each write is acknowledged the next local read has it."""
    srv, keys, _ = server
    def rows_of(part: np.ndarray, version: int) -> np.ndarray:
        return np.repeat(((part % 1000) * 1000 + version).astype(np.float32)[:, None], DIM, axis=1)

    with LocalClient(srv.store) as local:
        hot = keys[:256]
        srv.put(hot, rows_of(hot, 2), 2)
        assert (local.lookup_with_sources("m", "item", hot).sources <= 2).all()
        problems: list[str] = []
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                got = local.lookup("m", "item", hot)
                whole = (got == got[:, :1]).all(axis=1)
                if not whole.all():
                    problems.append(f"torn rows: {np.flatnonzero(~whole)[:5].tolist()}")
                    return

        reader = threading.Thread(target=read)
        reader.start()
        rng = np.random.default_rng(5)
        for version in range(3, 43):
            part = hot[rng.permutation(256)[:128]]
            rows = rows_of(part, version)
            srv.put(part, rows, version)
            np.testing.assert_array_equal(local.lookup("m", "item", part), rows)  # visible when acknowledged
        stop.set()
        reader.join(30)
        assert not problems, problems


def test_a_restart_under_a_reading_loop_raises_nothing_and_rows_stay_right(tmp_path: Path, shm: Path) -> None:
    keys, vectors = synthesize_model(3000, DIM, seed=4)
    _import(tmp_path / "db", keys, vectors)
    srv = LocalServer(tmp_path, shm / "restart").start(3000)
    errors: list[BaseException] = []
    reads = [0, 0]  # while mapped, while not
    stop = threading.Event()
    local = LocalClient(srv.store, timeout=120)

    def loop() -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            idx = rng.integers(0, keys.shape[0], 128)
            try:
                np.testing.assert_array_equal(local.lookup("m", "item", keys[idx]), vectors[idx])
            except BaseException as exc:  # noqa: BLE001 - none may happen
                errors.append(exc)
                return
            reads[0 if local.mapped else 1] += 1

    reader = threading.Thread(target=loop)
    reader.start()
    try:
        time.sleep(0.5)
        old = local.colocated._view.generation if local.colocated._view is not None else None
        assert srv.stop() == 0
        srv = LocalServer(tmp_path, shm / "restart")
        srv.srv.start(timeout=120)
        deadline = time.monotonic() + 120
        while local.colocated._view is None or local.colocated._view.generation == old:
            assert time.monotonic() < deadline and reader.is_alive(), errors
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        stop.set()
        reader.join(150)
        srv.stop()
        local.close()
    assert not errors, errors[:3]
    assert local.remaps >= 1 and reads[0] > 0


def test_a_socket_that_is_not_there_is_named_at_once(tmp_path: Path) -> None:
    """No store to learn the socket from and nothing at the default one: the first call that needs the server fails
    at once with UnavailableError naming the socket, instead of waiting out its timeout."""
    with LocalClient(tmp_path / "no-store", timeout=60) as local:
        started = time.monotonic()
        with pytest.raises(UnavailableError, match=str(tmp_path / "no-store" / "grpc.sock")):
            local.lookup("m", "item", [1, 2])
        with pytest.raises(UnavailableError, match="socket_path"):
            local.list_models()
        assert time.monotonic() - started < 5
