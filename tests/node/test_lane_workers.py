"""A node with the default ``cache.enabled: auto`` on a CPU (no L1 in front of the hash map): every worker and a
LocalClient read the hash map in one compiled pass, and the table's complete state, which the owner publishes in the
shared store, answers a key the hash map does not hold with the default, through every worker and the LocalClient,
with no RocksDB read and no call to the server; an eviction loses it for all of them at once, and RocksDB answers."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from hps_service.local import LocalClient
from tests.node.test_workers import AUTH, DIM, ROWS, start_node

DEFAULT, VOLATILE, PERSISTENT = 4, 2, 3


def _table(n) -> dict:  # noqa: ANN001
    return n.http.get("/v1/stats").json()["models"]["m"]["tables"]["item"]


def _lookups(n) -> float:  # noqa: ANN001
    """Lookups the server answered (every worker's and the owner's), from /metrics."""
    return sum(float(line.split()[-1]) for line in n.http.get("/metrics").text.splitlines()
               if line.startswith('hps_lookup_requests_total{method="Lookup"'))


def test_workers_and_a_local_client_read_the_pass_and_share_the_complete_state(tmp_path: Path) -> None:
    store = Path(tempfile.mkdtemp(prefix="hps-lane-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    n, keys, vectors = start_node(tmp_path, cache={"enabled": "auto"}, volatile={"type": "hashmap",
                                                                                 "capacity_rows": ROWS + 500},
                                  server={"local": {"enabled": True, "path": str(store / "s")}})
    try:
        deadline = time.monotonic() + 60
        while not _table(n)["volatile"].get("complete"):  # the preload ends: the table is complete
            assert time.monotonic() < deadline, _table(n)["volatile"]
            time.sleep(0.1)
        assert not _table(n)["cache"]["enabled"]
        absent = np.arange(2**40, 2**40 + 64, dtype=np.int64)
        asked = np.concatenate([keys[:200], absent, keys[:50], [-(2**63), 2**63 - 1]])
        want = np.concatenate([vectors[:200], np.zeros((64, DIM), np.float32), vectors[:50],
                               np.zeros((2, DIM), np.float32)])
        before = _table(n)["persistent"]
        for client in n.channels_to_each_worker():
            got = client.lookup_with_sources("m", "item", asked)
            np.testing.assert_array_equal(got.vectors, want)
            assert (got.sources == np.where((want != 0).any(axis=1), VOLATILE, DEFAULT)).all()
            client.close()
        with LocalClient(store / "s") as local:
            calls = _lookups(n)
            got = local.lookup_with_sources("m", "item", asked)
            np.testing.assert_array_equal(got.vectors, want)
            np.testing.assert_array_equal(local.lookup("m", "item", asked), want)  # the Rows call's own pass
            out = np.empty((asked.shape[0], DIM), np.float32)
            assert local.lookup("m", "item", asked, out=out) is out
            np.testing.assert_array_equal(out, want)
            assert _lookups(n) == calls, "a complete table's defaults went to the server"
        after = _table(n)["persistent"]
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"]), "RocksDB was read"

        fresh = np.arange(2**41, 2**41 + 1000, dtype=np.int64)  # past the hash map's capacity: an eviction
        rows = np.full((1000, DIM), 3.0, np.float32)
        r = n.http.put("/v1/models/m/tables/item/embeddings", headers=AUTH,
                       json={"keys": fresh.tolist(), "vectors": rows.tolist(), "version": 2})
        assert r.status_code == 200, r.text
        assert not _table(n)["volatile"]["complete"] and _table(n)["volatile"]["evictions"] > 0
        everything = np.concatenate([keys, fresh])
        expected = np.concatenate([vectors, rows])
        with LocalClient(store / "s") as local:
            for client in n.channels_to_each_worker():
                got = client.lookup_with_sources("m", "item", everything)
                np.testing.assert_array_equal(got.vectors, expected)
                assert (got.sources == PERSISTENT).any()  # the evicted rows, from RocksDB
                client.close()
            np.testing.assert_array_equal(local.lookup("m", "item", everything), expected)
    finally:
        n.srv.stop()
        n.http.close()
        shutil.rmtree(store, ignore_errors=True)
