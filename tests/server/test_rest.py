"""The REST admin API through httpx against a real in-process server (gRPC and HTTP on free ports)."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hps_service.admin.importer import synthesize_model, write_hugectr_dir
from hps_service.client import HPSClient
from hps_service.serve.process import HPSServer
from tests.helpers import ServerProcess, free_port, write_config
from tests.server.conftest import (
    AUTH,
    ITEM_DIM,
    TOKEN,
    USER_DIM,
    base_url,
    running,
    server_config,
    target,
    wait_job,
)

ROWS = "/v1/models/demo/tables/{table}/embeddings"


def _put(http: httpx.Client, table: str, keys: list[int], vectors: np.ndarray, version: int = 0) -> httpx.Response:
    return http.put(ROWS.format(table=table), json={"keys": keys, "vectors": vectors.tolist(), "version": version},
                    headers=AUTH)


def _get(http: httpx.Client, table: str, keys: list[int]) -> dict:
    r = http.get(ROWS.format(table=table), params={"keys": ",".join(map(str, keys))})
    assert r.status_code == 200, r.text
    return r.json()


def test_health_ready_docs_and_openapi(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["models"] == ["demo"]
    assert "swagger" in http.get("/docs").text.lower()
    paths = http.get("/openapi.json").json()["paths"]
    for p in ("/v1/models", "/v1/models/{model}", "/v1/models/{model}/tables/{table}/embeddings", "/v1/stats",
              "/v1/models/{model}/snapshots", "/v1/jobs/{job_id}", "/metrics", "/readyz"):
        assert p in paths


def test_readiness_hooks_and_gate(server: HPSServer, http: httpx.Client) -> None:
    def not_assigned() -> str:
        return "update consumer has no partitions yet"

    server.readiness.append(not_assigned)
    try:
        r = http.get("/readyz")
        assert r.status_code == 503
        assert r.json()["not_ready"] == ["update consumer has no partitions yet"]
        assert "not ready" in r.json()["error"]
    finally:
        server.readiness.remove(not_assigned)
    assert http.get("/readyz").status_code == 200


def _mutating_operations(http: httpx.Client) -> list[tuple[str, str]]:
    spec = http.get("/openapi.json").json()
    fill = {"{model}": "demo", "{table}": "item", "{snapshot_id}": "none", "{job_id}": "none"}
    ops = []
    for path, methods in spec["paths"].items():
        for method in methods:
            if method in ("post", "put", "delete") and not path.endswith(":lookup"):  # POST ...:lookup is a read
                for k, v in fill.items():
                    path = path.replace(k, v)
                ops.append((method.upper(), path))
    return ops


def test_every_mutating_endpoint_needs_the_token(http: httpx.Client) -> None:
    ops = _mutating_operations(http)
    assert len(ops) >= 9
    for method, path in ops:
        missing = http.request(method, path, json={})
        assert missing.status_code == 401, (method, path, missing.text)
        assert missing.headers["www-authenticate"] == "Bearer"
        assert "Authorization" in missing.json()["error"]
        wrong = http.request(method, path, json={}, headers={"Authorization": "Bearer not-the-token"})
        assert wrong.status_code == 403, (method, path, wrong.text)
        assert wrong.json()["error"] == wrong.json()["detail"] == "invalid admin token"
        basic = http.request(method, path, json={}, headers={"Authorization": f"Basic {TOKEN}"})
        assert basic.status_code == 401
    ok = _put(http, "item", [900_001], np.ones((1, ITEM_DIM), np.float32))
    assert ok.status_code == 200 and ok.json() == {"model_version": 0, "written": 1, "stale": 0}


def test_admin_disabled_without_a_token(tmp_path: Path) -> None:
    with running(server_config(tmp_path, token=None)) as srv, httpx.Client(base_url=base_url(srv)) as http:
        for method, path in _mutating_operations(http):
            r = http.request(method, path, json={}, headers=AUTH)
            assert r.status_code == 403 and "disabled" in r.json()["error"], (method, path)
        assert http.get("/v1/models/demo").status_code == 200


def test_put_get_delete_round_trip_with_versions(http: httpx.Client) -> None:
    keys = [11, 12, -13, 2**62]
    rows = np.arange(len(keys) * ITEM_DIM, dtype=np.float32).reshape(len(keys), ITEM_DIM) / 7
    assert _put(http, "item", keys, rows, version=5).json() == {"model_version": 0, "written": len(keys), "stale": 0}
    got = _get(http, "item", keys + [14])
    np.testing.assert_array_equal(np.array(got["vectors"][:4], np.float32), rows)
    assert got["vectors"][4] == [0.0] * ITEM_DIM and got["sources"][4] == "default"
    assert set(got["sources"][:4]) <= {"cache", "volatile", "persistent"}
    assert got["keys"] == keys + [14] and got["dim"] == ITEM_DIM
    # an older version never replaces a newer row
    assert _put(http, "item", keys[:2], rows[:2] + 1, version=4).json() == {"model_version": 0, "written": 0, "stale": 2}
    np.testing.assert_array_equal(np.array(_get(http, "item", keys)["vectors"], np.float32), rows)
    r = http.request("DELETE", ROWS.format(table="item"), json={"keys": keys[:2] + [999_999]}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"model_version": 0, "deleted": 2}
    after = _get(http, "item", keys)
    assert after["sources"][:2] == ["default", "default"] and after["vectors"][0] == [0.0] * ITEM_DIM
    np.testing.assert_array_equal(np.array(after["vectors"][2:], np.float32), rows[2:])
    # a delete naming a version is a tombstone, with or without Kafka: an older put landing after it stays deleted,
    # a row newer than it is kept
    assert _put(http, "item", keys[3:], rows[3:], version=20).json() == {"model_version": 0, "written": 1, "stale": 0}
    r = http.request("DELETE", ROWS.format(table="item"), json={"keys": keys[2:], "version": 10}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert _put(http, "item", keys[2:3], rows[2:3] + 1, version=9).json() == {"model_version": 0, "written": 0, "stale": 1}
    after = _get(http, "item", keys[2:])
    assert after["sources"][0] == "default" and after["sources"][1] != "default"
    np.testing.assert_array_equal(np.array(after["vectors"][1:], np.float32), rows[3:])


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b'{"keys": [1], "vectors": [[NaN, 1, 2, 3]]}', 400, "NaN"),
        (b'{"keys": [1], "vectors": [[Infinity, 1, 2, 3]]}', 400, "NaN or infinite"),
        (b'{"keys": [1], "vectors": [[1e39, 1, 2, 3]]}', 400, "NaN or infinite"),
        (b'{"keys": [1], "vectors": [[1, 2, 3]]}', 400, "dim 4"),
        (b'{"keys": [1, 2], "vectors": [[1, 2, 3, 4]]}', 400, "shape"),
        (b'{"keys": [1, 2], "vectors": [[1, 2, 3, 4], [1, 2]]}', 400, "equal length"),
        (b'{"keys": [1], "vectors": [["a", 2, 3, 4]]}', 422, "vectors"),
        (b'{"keys": [18446744073709551615], "vectors": [[1, 2, 3, 4]]}', 422, "keys"),
        (b'{"vectors": [[1, 2, 3, 4]]}', 422, "keys"),
        (b'not json', 422, "invalid request"),
    ],
)
def test_put_rejects_bad_rows(http: httpx.Client, body: bytes, status: int, fragment: str) -> None:
    r = http.put(ROWS.format(table="user"), content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]
    assert _get(http, "user", [1, 2])["sources"] == ["default", "default"]


def test_lookup_errors_are_json(http: httpx.Client, server: HPSServer) -> None:
    cases = [
        (ROWS.format(table="nope") + "?keys=1", 404, "no table 'nope'"),
        ("/v1/models/nope/tables/item/embeddings?keys=1", 404, "model 'nope' is not loaded"),
        (ROWS.format(table="item") + "?keys=1,x", 400, "'x'"),
        (ROWS.format(table="item") + "?keys=99999999999999999999", 400, "int64"),
        # digits str.isdigit() accepts but int() refuses, and int() spellings that are not plain decimals
        (ROWS.format(table="item") + "?keys=1,%C2%B9", 400, "'\u00b9'"),
        (ROWS.format(table="item") + "?keys=1_0", 400, "'1_0'"),
        (ROWS.format(table="item") + "?keys=%D9%A3", 400, "'\u0663'"),
        (ROWS.format(table="item"), 422, "keys"),
        ("/v1/models/nope", 404, "not loaded"),
        ("/v1/jobs/nope", 404, "no job"),
        # names no model may have, holding the mark of a version's served name (schemathesis found these answering 500)
        ("/v1/models/x%23vabc", 404, "model 'x#vabc' is not loaded"),
        ("/v1/models/x%23v%C2%B2/versions", 404, "model 'x#v\u00b2' is not loaded"),
        ("/v1/models/x%23v/tables/item/embeddings?keys=1", 404, "model 'x#v' is not loaded"),
    ]
    for url, status, fragment in cases:
        r = http.get(url)
        assert r.status_code == status, (url, r.text)
        assert fragment in r.json()["error"], (url, r.text)
    r = http.delete("/v1/models/x%23v/versions/7", headers=AUTH)
    assert r.status_code == 404 and "version 7 of model 'x#v' is not loaded" in r.json()["error"], r.text
    too_many = ",".join(map(str, range(server.config.server.max_batch_keys + 1)))
    r = http.get(ROWS.format(table="item"), params={"keys": too_many})
    assert r.status_code == 413 and "max_batch_keys" in r.json()["error"]


def test_import_job_then_lookups(http: httpx.Client, server: HPSServer, tmp_path: Path) -> None:
    keys, vectors = synthesize_model(3000, ITEM_DIM, seed=5)
    stale_key = int(keys[0])
    assert _put(http, "item", [stale_key], np.full((1, ITEM_DIM), 9.0, np.float32), version=0).status_code == 200
    assert _get(http, "item", [stale_key])["vectors"][0] == [9.0] * ITEM_DIM  # now held in L1/L2 too
    src = tmp_path / "item_sparse"
    write_hugectr_dir(src, keys, vectors)
    r = http.post("/v1/models/demo/tables/item/import", json={"path": str(src), "version": 1}, headers=AUTH)
    assert r.status_code == 202, r.text
    job = wait_job(http, r.json()["id"])
    assert job["state"] == "succeeded", job
    assert job["rows_total"] == job["rows_done"] == 3000 and job["progress"] == 1.0
    assert job["result"]["rows_written"] == 3000
    with HPSClient(target(server)) as client:
        got = client.lookup("demo", "item", keys)
    np.testing.assert_array_equal(got, vectors)  # the stale upper-tier copy of keys[0] was evicted
    assert any(j["id"] == job["id"] for j in http.get("/v1/jobs").json()["jobs"])


def test_import_errors(http: httpx.Client, tmp_path: Path) -> None:
    missing = http.post("/v1/models/demo/tables/item/import", json={"path": str(tmp_path / "nope.npz")}, headers=AUTH)
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]
    wrong_dim = tmp_path / "wrong.npz"
    np.savez(wrong_dim, keys=np.arange(10, dtype=np.int64), vectors=np.ones((10, ITEM_DIM + 1), np.float32))
    r = http.post("/v1/models/demo/tables/item/import", json={"path": str(wrong_dim)}, headers=AUTH)
    assert r.status_code == 400 and f"has dim {ITEM_DIM + 1}" in r.json()["detail"], r.text  # before any job
    cut = tmp_path / "cut.npz"
    cut.write_bytes(wrong_dim.read_bytes()[:200])
    r = http.post("/v1/models/demo/tables/item/import", json={"path": str(cut)}, headers=AUTH)
    assert r.status_code == 400 and "not a readable .npz file" in r.json()["detail"], r.text
    nan = tmp_path / "nan.npz"
    rows = np.ones((10, ITEM_DIM), np.float32)
    rows[7, 2] = np.nan
    np.savez(nan, keys=np.arange(770_000, 770_010, dtype=np.int64), vectors=rows)
    job = wait_job(http, http.post("/v1/models/demo/tables/item/import", json={"path": str(nan)},
                                   headers=AUTH).json()["id"])
    assert job["state"] == "failed" and "row 7 has NaN or inf" in job["error"], job
    assert _get(http, "item", [770_000])["sources"] == ["default"]  # checked whole first: nothing written
    unknown = http.post("/v1/models/demo/tables/nope/import", json={"path": str(wrong_dim)}, headers=AUTH)
    assert unknown.status_code == 404


def test_snapshot_create_list_restore(http: httpx.Client, server: HPSServer) -> None:
    keys = list(range(5000, 5100))
    original = np.random.default_rng(1).standard_normal((100, USER_DIM)).astype(np.float32)
    assert _put(http, "user", keys, original, version=3).status_code == 200
    r = http.post("/v1/models/demo/snapshots", headers=AUTH)
    assert r.status_code == 201, r.text
    snap = r.json()
    assert snap["model"] == "demo" and snap["tables"]["user"]["rows"] >= 100
    listed = http.get("/v1/models/demo/snapshots").json()["snapshots"]
    assert snap["id"] in [s["id"] for s in listed]
    assert http.get(f"/v1/models/demo/snapshots/{snap['id']}").json()["id"] == snap["id"]
    # after the snapshot: newer versions of half the rows, and rows the snapshot never had
    assert _put(http, "user", keys[:50], original[:50] + 100, version=7).json() == {"model_version": 0, "written": 50, "stale": 0}
    assert _put(http, "user", [77_000, 77_001], np.ones((2, USER_DIM), np.float32), version=9).status_code == 200
    assert _get(http, "user", [77_000])["sources"] != ["default"]
    # and a versioned delete (an update tombstone) of rows the snapshot holds
    server.engine.apply_deletes("demo", "user", np.array(keys[90:]), versions=11)
    assert set(_get(http, "user", keys[90:])["sources"]) == {"default"}
    r = http.post(f"/v1/models/demo/snapshots/{snap['id']}/restore", headers=AUTH)
    assert r.status_code == 202, r.text
    job = wait_job(http, r.json()["id"])
    assert job["state"] == "succeeded", job
    assert job["result"]["tables"]["user"]["rows_deleted"] >= 2
    with HPSClient(target(server)) as client:
        got = client.lookup_with_sources("demo", "user", np.array(keys + [77_000, 77_001]))
    np.testing.assert_array_equal(got.vectors[:100], original)
    np.testing.assert_array_equal(got.vectors[100:], 0.5)
    assert set(got.sources[100:]) == {4}
    assert http.post("/v1/models/demo/snapshots/nope/restore", headers=AUTH).status_code == 404
    assert http.get("/v1/models/demo/snapshots/..%2f..").status_code in (400, 404)
    assert http.delete(f"/v1/models/demo/snapshots/{snap['id']}", headers=AUTH).status_code == 200
    assert snap["id"] not in [s["id"] for s in http.get("/v1/models/demo/snapshots").json()["snapshots"]]


def test_register_describe_unload_model_keeps_grpc_health_in_sync(http: httpx.Client, server: HPSServer) -> None:
    body = {"name": "runtime", "tables": [{"name": "t", "dim": 3, "default": {"constant": 0.25}}]}
    r = http.post("/v1/models", json=body, headers=AUTH)
    assert r.status_code == 201, r.text
    assert r.json()["tables"][0]["dim"] == 3 and r.json()["replicated"] is False  # no fleet: this server only
    assert http.post("/v1/models", json=body, headers=AUTH).status_code == 409
    bad = http.post("/v1/models", json={"name": "bad name!", "tables": []}, headers=AUTH)
    assert bad.status_code == 422 and "error" in bad.json()
    assert _put_model_rows(http) == 1
    desc = http.get("/v1/models/runtime").json()
    assert desc["tables"][0]["rows"]["persistent"] == 1
    with grpc.insecure_channel(target(server)) as channel, HPSClient(target(server)) as client:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="runtime")).status == 1
        assert "runtime" in client.list_models()
        np.testing.assert_array_equal(client.lookup("runtime", "t", [1, 2]),
                                      [[1, 2, 3], [0.25, 0.25, 0.25]])
        assert http.delete("/v1/models/runtime", headers=AUTH).json() == {"unloaded": "runtime", "replicated": False}
        assert health.Check(health_pb2.HealthCheckRequest(service="runtime")).status == 2  # NOT_SERVING
        assert "runtime" not in client.list_models()
    assert http.get("/v1/models/runtime").status_code == 404
    assert http.delete("/v1/models/runtime", headers=AUTH).status_code == 404


def test_a_worker_shows_an_unloaded_model_not_serving_though_it_missed_that_publish(tmp_path: Path) -> None:
    """The owner publishes an unloaded model NOT_SERVING once and leaves it out of its next publish (0.2 s later at
    most); a worker that followed only the later one kept answering SERVING for the model (a flake of the test
    above)."""
    with running(server_config(tmp_path)) as srv:
        assert srv.node is not None and srv.engine is not None and srv._health_thread is not None
        srv._health_stop.set()  # from here on the owner publishes health only when this test says
        srv._health_thread.join(5)
        with httpx.Client(base_url=base_url(srv), timeout=30) as http:
            body = {"name": "runtime", "tables": [{"name": "t", "dim": 3}]}
            assert http.post("/v1/models", json=body, headers=AUTH).status_code == 201
        with grpc.insecure_channel(target(srv)) as channel:  # a worker answers (only workers serve the port)
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service="runtime")).status == 1
            srv.engine.unregister_model("runtime")
            srv._served_models.discard("runtime")  # the NOT_SERVING publish is overwritten before the worker looks
            srv.update_health()
            assert health.Check(health_pb2.HealthCheckRequest(service="runtime")).status == 2  # NOT_SERVING


def _put_model_rows(http: httpx.Client) -> int:
    r = http.put("/v1/models/runtime/tables/t/embeddings", json={"keys": [1], "vectors": [[1, 2, 3]]}, headers=AUTH)
    return r.json()["written"]


def test_stats_shape_and_cache_control(http: httpx.Client) -> None:
    keys = list(range(60_000, 60_050))
    assert _put(http, "item", keys, np.ones((50, ITEM_DIM), np.float32)).status_code == 200
    _get(http, "item", keys)
    _get(http, "item", keys)
    stats = http.get("/v1/stats").json()
    table = stats["models"]["demo"]["tables"]["item"]
    for level in ("cache", "volatile", "persistent"):
        for field in ("hits", "misses", "hit_rate", "rows", "capacity", "evictions"):
            assert field in table[level], (level, field)
    assert table["cache"]["hits"] >= 50
    assert "updates" in stats
    cache = http.get("/v1/cache/demo/item").json()
    assert cache["rows"] >= 50
    assert http.get("/v1/cache").json()["models"]["demo"]["tables"]["item"]["rows"] == cache["rows"]
    assert http.post("/v1/cache/demo/item/clear", headers=AUTH).json() == {"cleared": True, "enabled": True}
    assert http.get("/v1/cache/demo/item").json()["rows"] == 0
    assert set(_get(http, "item", keys)["sources"]) == {"volatile"}
    assert http.post("/v1/cache/demo/nope/clear", headers=AUTH).status_code == 404


def test_hps_serve_serves_rest_with_env_token(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "config.yaml", {
        "server": {"host": "127.0.0.1", "grpc_port": grpc_port, "http_port": http_port},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "rocksdb")},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 2}]}],
    })
    with ServerProcess(cfg, grpc_port, env={"HPS_ADMIN_TOKEN": "from-env"}), \
            httpx.Client(base_url=f"http://127.0.0.1:{http_port}") as http:
        assert http.get("/readyz").status_code == 200
        body = {"keys": [5], "vectors": [[0.5, 1.5]]}
        assert http.put("/v1/models/demo/tables/item/embeddings", json=body).status_code == 401
        r = http.put("/v1/models/demo/tables/item/embeddings", json=body, headers={"Authorization": "Bearer from-env"})
        assert r.json() == {"model_version": 0, "written": 1, "stale": 0}
        assert _get(http, "item", [5])["vectors"] == [[0.5, 1.5]]


def test_purge_tombstones_job(http: httpx.Client, server: HPSServer) -> None:
    """Versioned deletes (as update tombstones) leave tombstones in RocksDB; the admin job removes the old ones."""
    assert server.engine is not None
    rocksdb = server.engine.persistent
    keys = np.arange(700_000, 700_100, dtype=np.int64)
    assert _put(http, "item", keys.tolist(), np.ones((100, ITEM_DIM), np.float32), version=1).status_code == 200
    before = rocksdb.tombstones("demo.item")
    server.engine.apply_deletes("demo", "item", keys[:60], np.full(60, 5, dtype=np.int64))
    server.engine.apply_deletes("demo", "item", keys[60:], np.full(40, 9, dtype=np.int64))
    assert rocksdb.tombstones("demo.item") == before + 100
    url = "/v1/models/demo/tables/item/tombstones/purge"
    assert http.post(url, json={"below_version": 7}).status_code == 401  # admin only
    assert http.post(url, json={"below_version": -1}, headers=AUTH).status_code == 422
    assert http.post("/v1/models/demo/tables/nope/tombstones/purge", json={"below_version": 7},
                     headers=AUTH).status_code == 404
    r = http.post(url, json={"below_version": 7}, headers=AUTH)
    assert r.status_code == 202, r.text
    job = wait_job(http, r.json()["id"])
    assert job["state"] == "succeeded", job
    purged = job["result"]["purged"]["persistent"]
    assert 60 <= purged <= before + 60  # the v5 ones (and older ones other tests left), never the v9 ones
    assert rocksdb.tombstones("demo.item") == before + 100 - purged
    # The newer tombstones still hold: a replayed put older than them is refused.
    server.engine.apply_updates("demo", "item", keys[60:], np.full((40, ITEM_DIM), 3.0, np.float32), 8)
    assert all(v == [0.0] * ITEM_DIM for v in _get(http, "item", keys[60:].tolist())["vectors"])


def test_post_lookup_takes_max_batch_keys_and_errors_are_problem_json(tmp_path: Path) -> None:
    """65,536 keys (the default server.max_batch_keys) in a JSON body, where the query string stops at a few
    thousand; one more is 413; every error is RFC 9457 problem+json that still carries ``error``."""
    with running(server_config(tmp_path, max_batch_keys=65_536)) as srv, \
            httpx.Client(base_url=base_url(srv), timeout=60) as http:
        stored = np.arange(1, 101, dtype=np.int64)
        assert _put(http, "item", stored.tolist(), np.ones((100, ITEM_DIM), np.float32) * 3).status_code == 200
        keys = np.concatenate([stored, np.arange(10**9, 10**9 + 65_436)])
        np.random.default_rng(0).shuffle(keys)
        r = http.post(ROWS.format(table="item") + ":lookup", json={"keys": keys.tolist()})
        assert r.status_code == 200, r.text[:300]
        body = r.json()
        vectors = np.array(body["vectors"], dtype=np.float32)
        assert body["keys"] == keys.tolist() and vectors.shape == (65_536, ITEM_DIM)
        stored_at = np.isin(keys, stored)
        assert (vectors[stored_at] == 3).all() and (vectors[~stored_at] == 0).all()
        assert {body["sources"][i] for i in np.flatnonzero(~stored_at)} == {"default"}
        over = http.post(ROWS.format(table="item") + ":lookup", json={"keys": list(range(65_537))})
        cases = [
            (over, 413, "max_batch_keys=65536"),
            (http.post("/v1/models/demo/tables/nope/embeddings:lookup", json={"keys": [1]}), 404, "no table 'nope'"),
            (http.post(ROWS.format(table="item") + ":lookup", json={"keys": ["x"]}), 422, "keys"),
            (http.post(ROWS.format(table="item") + ":lookup", json={"keys": [2**63]}), 422, "keys"),
            (http.get(ROWS.format(table="item"), params={"keys": "1,x"}), 400, "'x'"),
            (http.delete("/v1/models/demo"), 401, "Authorization"),
        ]
        for response, status, fragment in cases:
            assert response.status_code == status, response.text[:300]
            assert response.headers["content-type"] == "application/problem+json"
            problem = response.json()
            assert problem["status"] == status and problem["type"] == "about:blank" and problem["title"]
            assert fragment in problem["detail"] and problem["error"] == problem["detail"]
        invalid = cases[2][0].json()
        assert invalid["errors"][0]["loc"][:2] == ["body", "keys"]
