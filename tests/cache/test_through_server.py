"""L1 through the server: a table larger than the cache, zipf keys over gRPC; the hit rate in /v1/stats matches a
plain-Python reference model of the cache fed the same requests, and every answer equals the row in RocksDB."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np

from hps_service.admin.importer import synthesize_model
from hps_service.client import HPSClient
from hps_service.config import load_config
from hps_service.serve.process import HPSServer
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.cache.cache_model import CacheModel

ROWS, DIM, CAPACITY, WAYS = 20_000, 16, 1024, 8


def test_zipf_hit_rate_matches_reference_model(tmp_path: Path) -> None:
    keys, vectors = synthesize_model(ROWS, DIM, seed=5)
    tier = RocksDBTier(tmp_path / "db")
    tier.create_table("m.t", DIM)
    tier.bulk_import("m.t", keys, vectors)
    tier.close()
    # workers: 0 (gRPC served in this process): the reference inserts each batch's misses before the next batch,
    # as inline admission does; a node's workers hand admissions to the owner, which inserts them a moment later.
    cfg = load_config(None, server={"grpc_port": 0, "http_port": 0, "workers": 0}, cache={"backend": "numpy", "capacity": CAPACITY, "ways": WAYS, "hit_rate_threshold": 1.0, "admit_after_misses": 1,
                  "warm_start": False}, volatile={"type": "disabled"}, persistent={"type": "rocksdb", "path": str(tmp_path / "db")}, models=[{"name": "m", "tables": [{"name": "t", "dim": DIM}]}])
    server = HPSServer(cfg)
    server.start()
    model = CacheModel(sets=CAPACITY // WAYS, ways=WAYS, policy="lru")
    rng = np.random.default_rng(11)
    rank = rng.zipf(1.05, size=(60, 256)) - 1
    hits = total = 0
    try:
        with HPSClient(f"127.0.0.1:{server.grpc_port}") as client:
            for batch in rank:
                idx = batch[batch < ROWS]
                answer = client.lookup_with_sources("m", "t", keys[idx])
                np.testing.assert_array_equal(answer.vectors, vectors[idx])
                # the reference: query every key, then insert the batch's unique misses (sorted, as the engine does)
                found = model.query(keys[idx].tolist())
                missed = sorted({int(k) for k, f in zip(keys[idx], found) if f is None})
                if missed:
                    model.insert(missed, [(0.0,)] * len(missed))
                hits += sum(f is not None for f in found)
                total += len(found)
                assert int(np.count_nonzero(answer.sources == 1)) == sum(f is not None for f in found)
        stats = httpx.get(f"http://127.0.0.1:{server.http_port}/v1/stats", timeout=5).json()
        cache = stats["models"]["m"]["tables"]["t"]["cache"]
        assert cache["hits"] == hits and cache["misses"] == total - hits
        assert abs(cache["hit_rate"] - hits / total) < 1e-9
        assert 0.2 < cache["hit_rate"] < 0.95  # a real mix: the table is 20x the cache
        assert cache["rows"] <= CAPACITY and cache["evictions"] > 0
    finally:
        server.stop(grace=1)


# ---------------------------------------------------------------------------------------------- issue 14
I64_EDGES = [-(2**63), 2**63 - 1, -1, 0]


def test_int64_edge_keys_are_never_answered_from_free_slots(tmp_path: Path) -> None:
    """Issue 14 defect 1, as reproduced through the server: rows cached, some deleted over REST, then the int64
    edges looked up. -2**63 was the free-slot marker and came back with a freed slot's row, counted a hit."""
    from tests.server.conftest import AUTH, USER_DIM, base_url, running, server_config, target

    rows_url = "/v1/models/demo/tables/user/embeddings"
    with running(server_config(tmp_path)) as srv, httpx.Client(base_url=base_url(srv), timeout=30) as http, \
            HPSClient(target(srv)) as client:
        keys = list(range(1, 65))
        vectors = np.arange(64 * USER_DIM, dtype=np.float32).reshape(64, USER_DIM) + 1
        assert http.put(rows_url, json={"keys": keys, "vectors": vectors.tolist(), "version": 1},
                        headers=AUTH).status_code == 200
        deadline = time.monotonic() + 10  # a node's workers hand their misses to the owner, which admits them
        while not ((answer := client.lookup_with_sources("demo", "user", keys)).sources == 1).all():
            assert time.monotonic() < deadline, "the rows were not cached"
            time.sleep(0.02)
        assert http.request("DELETE", rows_url, json={"keys": keys[:32]}, headers=AUTH).status_code == 200
        for _ in range(3):
            answer = client.lookup_with_sources("demo", "user", I64_EDGES)
            assert (answer.sources == 4).all(), f"edge keys answered from {answer.sources.tolist()}"
            assert (answer.vectors == 0.5).all()
        # The edges are ordinary keys: stored, cached, answered and deleted like any other.
        edge_rows = np.full((4, USER_DIM), 2.0, np.float32) + np.arange(4, dtype=np.float32)[:, None]
        assert http.put(rows_url, json={"keys": I64_EDGES, "vectors": edge_rows.tolist(), "version": 2},
                        headers=AUTH).status_code == 200
        deadline = time.monotonic() + 10
        while not ((answer := client.lookup_with_sources("demo", "user", I64_EDGES)).sources == 1).all():
            np.testing.assert_array_equal(answer.vectors, edge_rows)
            assert time.monotonic() < deadline, "the edge rows were not cached"
            time.sleep(0.02)
        np.testing.assert_array_equal(answer.vectors, edge_rows)
        assert http.request("DELETE", rows_url, json={"keys": I64_EDGES}, headers=AUTH).status_code == 200
        answer = client.lookup_with_sources("demo", "user", I64_EDGES)
        assert (answer.sources == 4).all() and (answer.vectors == 0.5).all()
