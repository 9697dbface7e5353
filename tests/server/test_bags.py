"""Pooled lookups as users make them, against ``hps serve`` with two workers and a colocated store: HPSClient,
AsyncHPSClient, LocalClient and REST answer every bag as torch's embedding_bag would over the rows a plain lookup
answers (sum, mean, weights, empty bags, keys no tier holds, duplicates across bags, fp16 and int8 tables, versions
and labels), a fleet of two shards answers what one server does, and every bad bag is refused naming its field, at
and one past each bound."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_client import AsyncHPSClient, Bags, HPSClient
from hps_client.errors import InvalidArgumentError, ResourceExhaustedError
from hps_service.local import LocalClient
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.engine.test_bags import reference
from tests.helpers import ServerProcess, free_port, write_config

TOKEN = "bags-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIM, ROWS, MAX_KEYS = 8, 2000, 4096
SUM, MEAN = 1, 2


class Node:
    """``hps serve`` (two workers, a colocated store) with three tables of stored rows and a version 1."""

    def __init__(self, tmp: Path) -> None:
        self.store = Path(tempfile.mkdtemp(prefix="hps-bags-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        grpc_port, http_port = free_port(), free_port()
        tables = [{"name": "f32", "dim": DIM, "default": {"constant": 0.25}},
                  {"name": "f16", "dim": DIM, "storage": "fp16"}, {"name": "i8", "dim": DIM, "storage": "int8"}]
        cfg = write_config(tmp / "hps.yaml", {
            "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": 2,
                       "max_batch_keys": MAX_KEYS, "local": {"enabled": True, "path": str(self.store)}},
            "cache": {"backend": "numpy", "capacity": 512, "admit_after_misses": 1},
            "volatile": {"type": "hashmap", "capacity_rows": 1000},  # some rows only in RocksDB
            "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
            "models": [{"name": "m", "tables": tables}],
        })
        self.srv = ServerProcess(cfg, grpc_port).start(timeout=120)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60, headers=AUTH)
        assert self.http.post("/v1/models/m/versions", json={"version": 1}).status_code == 201
        rng = np.random.default_rng(3)
        self.keys = np.arange(1, ROWS + 1, dtype=np.int64)
        for version in (0, 1):
            for t in tables:
                rows = rng.standard_normal((ROWS, DIM)).round(2)
                r = self.http.put(f"/v1/models/m/tables/{t['name']}/embeddings", params={"model_version": version},
                                  json={"keys": self.keys.tolist(), "vectors": rows.tolist(), "version": 1})
                assert r.status_code == 200, r.text
        self.client = HPSClient(self.srv.target)

    def close(self) -> None:
        self.client.close()
        self.http.close()
        self.srv.stop()
        shutil.rmtree(self.store, ignore_errors=True)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("bags"))
    try:
        yield n
    finally:
        n.close()


def random_bags(rng: np.random.Generator, n_bags: int, mean_len: int, combiner: int) -> tuple:
    """Keys (stored ones, unstored ones, duplicates within and across bags), offsets with empty bags, weights."""
    lengths = rng.poisson(mean_len, n_bags)
    lengths[rng.random(n_bags) < 0.1] = 0
    keys = rng.integers(-20, ROWS + 50, int(lengths.sum())).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    weights = rng.standard_normal(keys.shape[0]).astype(np.float32) if combiner == SUM and rng.random() < .5 else None
    return keys, offsets, weights


@pytest.mark.parametrize("table", ["f32", "f16", "i8"])
def test_every_client_pools_as_the_reference_over_its_plain_lookups(node: Node, table: str) -> None:
    rng = np.random.default_rng(11)
    with LocalClient(node.store, timeout=30) as local:
        for combiner in (SUM, MEAN):
            for version in (None, 1):
                keys, offsets, weights = random_bags(rng, 64, 12, combiner)
                plain = node.client.lookup_with_sources("m", table, keys, version=version)
                want, deepest = reference(plain.vectors, plain.sources, offsets, combiner, weights)
                name = "sum" if combiner == SUM else "mean"
                got = node.client.lookup_bags_many("m", {table: Bags(keys, offsets, name, weights)},
                                                   version=version)[table]
                np.testing.assert_allclose(got.vectors, want, rtol=1e-5, atol=1e-5)
                # the plain lookup promoted what it read: a bag is answered from as high a level, or higher, but a
                # bag with a key no tier holds is DEFAULT in both, and an empty one UNSPECIFIED
                assert (got.sources <= deepest).all() and ((got.sources == 4) == (deepest == 4)).all()
                assert ((got.sources == 0) == (deepest == 0)).all()
                for _ in range(2):  # the first call maps the table, the second reads it mapped
                    mine = local.lookup_bags("m", table, keys, offsets, name, weights, version=version)
                    np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-5)

                np.testing.assert_allclose(asyncio.run(_async_bags(node, table, keys, offsets, name, weights, version)),
                                           want, rtol=1e-5, atol=1e-5)
                body = {"keys": keys.tolist(), "offsets": offsets.tolist(), "combiner": name}
                if weights is not None:
                    body["weights"] = weights.tolist()
                params = {"model_version": version} if version else {}
                r = node.http.post(f"/v1/models/m/tables/{table}/embeddings:lookup", params=params, json=body)
                assert r.status_code == 200, r.text
                answer = r.json()
                assert answer["bags"] == offsets.shape[0] and answer["version"] == (version or 0)
                np.testing.assert_allclose(np.array(answer["vectors"], np.float32), want, rtol=1e-5, atol=1e-5)


async def _async_bags(node: Node, table: str, keys: np.ndarray, offsets: np.ndarray, combiner: str,
                      weights: np.ndarray | None, version: int | None) -> np.ndarray:
    async with AsyncHPSClient(node.srv.target) as aio:
        return await aio.lookup_bags("m", table, keys, offsets, combiner, weights, version=version)


def test_a_label_names_the_pooled_version_and_the_answer_is_one_row_per_bag(node: Node) -> None:
    keys, offsets = node.keys[:64], np.arange(0, 64, 8, dtype=np.int64)
    assert node.http.put("/v1/models/m/labels/production", json={"version": 1}).status_code == 200
    try:
        stub = pb_grpc.EmbeddingServiceStub(node.client.transport._channel)  # type: ignore[attr-defined]
        request = pb.LookupRequest(model="m", tables=[pb.TableKeys(
            table="f32", keys=keys.tobytes(), offsets=offsets.tobytes(), combiner=pb.COMBINER_MEAN)])
        response = stub.Lookup(request, timeout=10)
        tv = response.tables[0]
        assert response.version == 1 and tv.pooled and tv.count == 8 and len(tv.vectors) == 8 * DIM * 4
        assert len(tv.sources) == 8
        rows = node.client.lookup("m", "f32", keys, version=1)
        np.testing.assert_allclose(np.frombuffer(tv.vectors, "<f4").reshape(8, DIM),
                                   rows.reshape(8, 8, DIM).mean(axis=1), rtol=1e-5, atol=1e-6)
    finally:
        node.http.delete("/v1/models/m/labels/production")


def raw(node: Node, **fields: object) -> grpc.RpcError:
    """The error of a Lookup of one pooled table built from ``fields``."""
    stub = pb_grpc.EmbeddingServiceStub(node.client.transport._channel)  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(pb.LookupRequest(model="m", tables=[pb.TableKeys(table="f32", **fields)]), timeout=10)
    return err.value


K3 = np.arange(1, 4, dtype=np.int64).tobytes()


@pytest.mark.parametrize("fields,fragment", [
    ({"keys": K3, "offsets": np.array([1], "<i8").tobytes(), "combiner": 1}, "offsets must start at 0"),
    ({"keys": K3, "offsets": np.array([0, 2, 1], "<i8").tobytes(), "combiner": 1}, "go backwards at bag 2"),
    ({"keys": K3, "offsets": np.array([0, 4], "<i8").tobytes(), "combiner": 1}, "past the 3 keys"),
    ({"keys": K3, "offsets": b"\x00" * 7, "combiner": 1}, "offsets is 7 bytes, not a multiple of 8"),
    ({"keys": K3, "offsets": np.array([0], "<i8").tobytes(), "combiner": 7}, "neither SUM (1) nor MEAN (2)"),
    ({"keys": K3, "offsets": np.array([0], "<i8").tobytes(), "combiner": 2,
      "weights": np.ones(3, "<f4").tobytes()}, "weights go with combiner SUM only"),
    ({"keys": K3, "offsets": np.array([0], "<i8").tobytes(), "combiner": 1,
      "weights": np.ones(2, "<f4").tobytes()}, "2 weights for 3 keys"),
    ({"keys": K3, "offsets": np.array([0], "<i8").tobytes(), "combiner": 1,
      "weights": np.array([1, np.inf, 1], "<f4").tobytes()}, "NaN or infinite"),
    ({"keys": K3, "offsets": np.array([0], "<i8").tobytes()}, "need a combiner"),
])
def test_bad_bags_are_invalid_argument_naming_the_table_and_field(node: Node, fields: dict, fragment: str) -> None:
    err = raw(node, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "table 'f32'" in err.details(), err.details()
    assert fragment in err.details(), err.details()


def test_bags_per_request_at_and_one_past_server_max_batch_keys(node: Node) -> None:
    at = node.client.lookup_bags("m", "f32", np.zeros(0, np.int64), np.zeros(MAX_KEYS, np.int64))
    assert at.shape == (MAX_KEYS, DIM) and not at.any()  # as many empty bags as the bound: zero rows
    err = raw(node, keys=b"", offsets=np.zeros(MAX_KEYS + 1, "<i8").tobytes(), combiner=1)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"{MAX_KEYS + 1} bags" in err.details()
    with pytest.raises(ResourceExhaustedError):
        node.client.lookup_bags("m", "f32", np.zeros(0, np.int64), np.zeros(MAX_KEYS + 1, np.int64))
    with pytest.raises(InvalidArgumentError, match="combiner 'max'"):
        node.client.lookup_bags("m", "f32", [1], [0], "max")


@pytest.mark.parametrize("body,status,fragment", [
    ({"keys": [1, 2], "offsets": [0, 3], "combiner": "sum"}, 400, "past the 2 keys"),
    ({"keys": [1, 2], "offsets": [0], "combiner": "mean", "weights": [1, 1]}, 400, "combiner SUM only"),
    ({"keys": [1, 2], "offsets": [0]}, 400, "need a combiner"),
    ({"keys": [1, 2], "combiner": "sum"}, 400, "needs offsets"),
    ({"keys": [1, 2], "offsets": [0], "combiner": "max"}, 422, "combiner"),
    ({"keys": [], "offsets": [0] * (MAX_KEYS + 1), "combiner": "sum"}, 413, "exceeds server.max_batch_keys"),
])
def test_rest_refuses_bad_bags_as_problem_json(node: Node, body: dict, status: int, fragment: str) -> None:
    r = node.http.post("/v1/models/m/tables/f32/embeddings:lookup", json=body)
    assert r.status_code == status and r.headers["content-type"].startswith("application/problem+json"), r.text
    assert fragment in json.dumps(r.json()), r.text


def test_pooled_calls_are_counted_apart_with_their_bags(node: Node) -> None:
    node.client.lookup_bags("m", "f32", node.keys[:10], [0, 5])
    metrics = node.http.get("/metrics").text
    assert 'hps_lookup_requests_total{method="LookupBags",status="OK"}' in metrics
    assert "hps_lookup_bags_count" in metrics and "hps_lookup_bags_sum" in metrics
