"""Row TTL through an in-process server (a node: its owner applies the writes, its worker processes answer gRPC by
their own clock): gRPC and REST answer a row older than its table's ``ttl_s`` with the default and source EXPIRED
(5), and refuse stored precision on that table. The rows are written with past write times by replacing
``ttl.clock`` in this (the owner's) process; lookups run by the real clock."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from hps_service.client import HPSClient
from hps_service.config import HPSConfig, load_config
from hps_service.engine import ttl
from hps_service.errors import InvalidArgumentError
from hps_service.local import LocalClient
from tests.helpers import free_port
from tests.server.conftest import AUTH, TOKEN, base_url, running, target

DIM, TTL = 8, 600


ROWS = np.arange(64, dtype=np.float32).reshape(8, DIM)
OLD, FRESH = np.arange(1, 5, dtype=np.int64), np.arange(5, 9, dtype=np.int64)


def ttl_config(tmp_path: Path, **server: Any) -> HPSConfig:
    return load_config(
        None,
        server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "admin_token": TOKEN,
                "grpc_workers": 2, **server},
        cache={"capacity": 4096},
        volatile={"type": "hashmap", "capacity_rows": 10_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "rocksdb"), "block_cache_mb": 8},
        models=[{"name": "demo", "tables": [{"name": "item", "dim": DIM, "ttl_s": TTL,
                                             "default": {"constant": 0.5}}]}],
    )


def put(http: httpx.Client, monkeypatch: pytest.MonkeyPatch, keys: np.ndarray, written_s: float,
        version: int = 1) -> None:
    """Rows of ``keys`` put over REST as if at ``written_s`` (the owner's clock, in this process)."""
    monkeypatch.setattr(ttl, "clock", lambda: written_s)
    r = http.put("/v1/models/demo/tables/item/embeddings", headers=AUTH,
                 json={"keys": keys.tolist(), "vectors": ROWS[keys - 1].tolist(), "version": version})
    monkeypatch.setattr(ttl, "clock", time.time)
    assert r.status_code == 200 and r.json()["written"] == keys.shape[0], r.text


def test_grpc_and_rest_answer_expired_rows_with_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, fresh, rows = OLD, FRESH, ROWS
    with running(ttl_config(tmp_path)) as srv, httpx.Client(base_url=base_url(srv), timeout=30) as http, \
            HPSClient(target(srv)) as client:

        def put_rows(keys: np.ndarray, written_s: float, version: int = 1) -> None:
            put(http, monkeypatch, keys, written_s, version)

        put_rows(old, time.time() - TTL - 60)  # expired a minute ago
        put_rows(fresh, time.time() - TTL + 300)  # five minutes left
        keys = np.concatenate((old, fresh))
        for _ in range(2):  # read through the tiers, then from L1
            answer = client.lookup_with_sources("demo", "item", keys)
            assert answer.sources.tolist()[:4] == [5] * 4  # SOURCE_EXPIRED
            assert not set(answer.sources.tolist()[4:]) & {4, 5}
            assert (answer.vectors[:4] == 0.5).all()
            np.testing.assert_array_equal(answer.vectors[4:], rows[4:])
        answer = client.lookup_with_sources("demo", "item", np.array([3, 100], np.int64))
        assert answer.sources.tolist() == [5, 4]  # SOURCE_EXPIRED, SOURCE_DEFAULT
        body = http.get("/v1/models/demo/tables/item/embeddings", params={"keys": "3,100,6"}).json()
        assert body["sources"][:2] == ["expired", "default"] and body["vectors"][:2] == [[0.5] * DIM] * 2
        assert body["vectors"][2] == rows[5].tolist()
        with pytest.raises(InvalidArgumentError, match="ttl_s"):
            client.lookup_stored("demo", "item", fresh)
        put_rows(old[:1], time.time(), version=2)  # written again: answered again
        answer = client.lookup_with_sources("demo", "item", old[:2])
        assert answer.sources[0] != 5 and answer.sources[1] == 5
        np.testing.assert_array_equal(answer.vectors[0], rows[0])
        # the owner's sweep removes the other expired rows from every tier and L1: the workers find none of them
        assert srv.engine.sweeper.sweep() == 3
        answer = client.lookup_with_sources("demo", "item", keys)
        assert answer.sources.tolist()[:4] == [answer.sources[0], 4, 4, 4] and answer.sources[0] not in (4, 5)
        assert not set(answer.sources.tolist()[4:]) & {4, 5}


def test_a_colocated_reader_answers_the_expired_rows_it_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows are in the hash map, so LocalClient answers them itself (by this process's clock): expired ones
    with the default and EXPIRED, the others as stored; a key it does not hold answers the default (the table is
    complete once preloaded, or the server says so), never EXPIRED (a complete table's default is no stored row)."""
    store = Path(tempfile.mkdtemp(prefix="hps-ttl-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        config = ttl_config(tmp_path, workers=1, local={"enabled": True, "path": str(store)})
        with running(config) as srv, httpx.Client(base_url=base_url(srv), timeout=30) as http:
            put(http, monkeypatch, OLD, time.time() - TTL - 60)
            put(http, monkeypatch, FRESH, time.time() - TTL + 300)
            with LocalClient(store) as local:
                keys = np.concatenate((OLD, FRESH, [100]))
                answer = local.lookup_with_sources("demo", "item", keys)
                assert answer.sources.tolist() == [5] * 4 + [2] * 4 + [4]  # expired, hash map, default
                assert (answer.vectors[:4] == 0.5).all() and (answer.vectors[8] == 0.5).all()
                np.testing.assert_array_equal(answer.vectors[4:8], ROWS[4:])
                many = local.lookup_many("demo", {"item": OLD})["item"]
                assert many.sources.tolist() == [5] * 4
                with pytest.raises(InvalidArgumentError, match="ttl_s"):
                    local.lookup_stored("demo", "item", FRESH)
    finally:
        shutil.rmtree(store, ignore_errors=True)
