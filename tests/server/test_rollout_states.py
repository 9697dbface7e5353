"""Issue 53, parts 1, 2 and 5 against a real in-process server: a version goes live only when it can serve (an empty
one is refused unless the switch allows it), every version says its state, source and rows (REST and metrics), one
meaning for each number (version 0 is the model as configured on every surface; no version is the label
production's on reads and writes alike), and a put says what it wrote and what was stale (strict refuses)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_client import HPSClient
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from tests.helpers import run_hps
from tests.server.conftest import AUTH, ITEM_DIM, USER_DIM, base_url, running, server_config, target

KEYS = np.arange(1, 33, dtype=np.int64)


def _put(http: httpx.Client, value: float, model_version: int | None = None, table: str = "item",
         dim: int = ITEM_DIM, row_version: int = 1, **params: str) -> httpx.Response:
    query = {**params, **({"model_version": str(model_version)} if model_version is not None else {})}
    return http.put(f"/v1/models/demo/tables/{table}/embeddings", params=query, headers=AUTH,
                    json={"keys": KEYS.tolist(), "vectors": np.full((KEYS.size, dim), value).tolist(),
                          "row_version": row_version})


def _fill(http: httpx.Client, value: float, model_version: int | None = None) -> None:
    """Rows in both tables of a version (it can then take a label without allow_empty)."""
    for table, dim in (("item", ITEM_DIM), ("user", USER_DIM)):
        r = _put(http, value, model_version, table, dim)
        assert r.status_code == 200, r.text


def _read(http: httpx.Client, **params: str) -> tuple[int, set[float]]:
    body = http.get("/v1/models/demo/tables/item/embeddings", params={"keys": "1,2,3", **params}).json()
    return body["version"], set(np.asarray(body["vectors"]).ravel().tolist())


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[HPSServer]:
    with running(server_config(tmp_path, workers=0)) as s:
        yield s


@pytest.fixture
def http(srv: HPSServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url(srv), timeout=30) as client:
        yield client


def test_a_label_is_refused_on_a_version_with_an_empty_table_unless_the_switch_allows_it(
        http: httpx.Client, srv: HPSServer) -> None:
    """Before: the switch answered 200 and every lookup then answered zeros from the default."""
    _fill(http, 1.0)
    assert http.post("/v1/models/demo/versions", json={"version": 3}, headers=AUTH).status_code == 201
    assert _put(http, 3.0, 3).status_code == 200  # item only: user holds no rows
    refused = http.put("/v1/models/demo/labels/production", json={"version": 3}, headers=AUTH)
    assert refused.status_code == 409, refused.text
    problem = refused.json()
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert "table user of version 3 of model 'demo' holds no rows" in problem["detail"], problem
    assert "table item" not in problem["detail"]
    assert _read(http) == (0, {1.0})  # nothing switched
    allowed = http.put("/v1/models/demo/labels/production", json={"version": 3, "allow_empty": True}, headers=AUTH)
    assert allowed.status_code == 200 and allowed.json()["version"] == 3, allowed.text
    assert _read(http) == (3, {3.0})
    missing = http.put("/v1/models/demo/labels/production", json={"version": 8}, headers=AUTH)
    assert missing.status_code == 409 and "no version 8 loaded" in missing.json()["detail"]


def test_versions_list_their_state_source_rows_and_bytes_and_the_metrics_carry_the_state(
        http: httpx.Client, tmp_path: Path, srv: HPSServer) -> None:
    _fill(http, 1.0)
    for version in (1, 2):
        assert http.post("/v1/models/demo/versions", json={"version": version}, headers=AUTH).status_code == 201
    _fill(http, 2.0, 2)
    assert http.put("/v1/models/demo/labels/production", json={"version": 2}, headers=AUTH).status_code == 200
    listed = http.get("/v1/models/demo/versions").json()
    by_version = {v["version"]: v for v in listed["versions"]}
    assert sorted(by_version) == [1, 2]
    one, two = by_version[1], by_version[2]
    assert (one["state"], two["state"]) == ("ready", "serving")
    assert one["source"] == "REST API" and two["labels"] == ["production"]
    assert {t["name"]: (t["rows"], t["bytes"]) for t in two["tables"]} == {
        "item": (KEYS.size, KEYS.size * ITEM_DIM * 4), "user": (KEYS.size, KEYS.size * USER_DIM * 4)}
    assert {t["name"]: t["rows"] for t in one["tables"]} == {"item": 0, "user": 0}
    assert isinstance(two["ready_at"], float) and two["reason"] is None
    shown = run_hps("versions", "demo", "--url", base_url(srv), env={"COLUMNS": "200"})
    assert shown.returncode == 0 and "serving" in shown.stdout and "item: 32, user: 32" in shown.stdout, shown
    single = http.get("/v1/models/demo/versions/2").json()
    assert single["state"] == "serving" and single["model"] == "demo"
    assert http.get("/v1/models/demo/versions/7").status_code == 404
    metrics = http.get("/metrics").text
    assert 'hps_model_version_state{model="demo",state="serving",version="2"} 1.0' in metrics
    assert 'hps_model_version_state{model="demo",state="ready",version="2"} 0.0' in metrics
    assert 'hps_model_version_state{model="demo",state="ready",version="1"} 1.0' in metrics
    assert f'hps_model_version_rows{{model="demo",table="item",version="2"}} {float(KEYS.size)}' in metrics


def test_a_restart_keeps_where_a_version_came_from(tmp_path: Path) -> None:
    config = server_config(tmp_path, workers=0)
    with running(config) as s, httpx.Client(base_url=base_url(s), timeout=30) as http:
        assert http.post("/v1/models/demo/versions", json={"version": 4}, headers=AUTH).status_code == 201
    with running(config) as s, httpx.Client(base_url=base_url(s), timeout=30) as http:
        (only,) = http.get("/v1/models/demo/versions").json()["versions"]
        assert (only["version"], only["state"], only["source"]) == (4, "ready", "REST API")


def test_version_0_is_the_model_as_configured_on_every_surface(http: httpx.Client, srv: HPSServer) -> None:
    """Before: REST ``?model_version=0`` and ``hps lookup --model-version 0`` read the labelled version (0 was
    "unset" there), while gRPC and the Python client read the model as configured."""
    _fill(http, 1.0)
    assert http.post("/v1/models/demo/versions", json={"version": 1}, headers=AUTH).status_code == 201
    _fill(http, 2.0, 1)
    assert http.put("/v1/models/demo/labels/production", json={"version": 1}, headers=AUTH).status_code == 200
    assert _read(http, model_version="0") == (0, {1.0})  # REST GET
    assert _read(http) == (1, {2.0})
    looked = http.post("/v1/models/demo/tables/item/embeddings:lookup", params={"model_version": 0},
                       json={"keys": [1, 2]}).json()
    assert looked["version"] == looked["model_version"] == 0 and set(np.asarray(looked["vectors"]).ravel().tolist()) == {1.0}
    with grpc.insecure_channel(target(srv)) as channel:  # gRPC: the field has presence
        request = pb.LookupRequest(model="demo", version=0, tables=[
            pb.TableKeys(table="item", keys=KEYS.astype("<i8").tobytes())])
        answer = pb_grpc.EmbeddingServiceStub(channel).Lookup(request, timeout=10)
        assert answer.version == 0 and set(np.frombuffer(answer.tables[0].vectors, "<f4").tolist()) == {1.0}
    with HPSClient(target(srv)) as client:  # Python
        assert set(client.lookup("demo", "item", KEYS, version=0).ravel().tolist()) == {1.0}
        assert set(client.lookup("demo", "item", KEYS).ravel().tolist()) == {2.0}
    for flags, value in ((["--model-version", "0"], 1.0), ([], 2.0), (["--model-version", "1"], 2.0)):  # CLI
        done = run_hps("lookup", "--target", target(srv), "--model", "demo", "--table", "item", "--json", "1", "2",
                       *flags)
        assert done.returncode == 0, done.stderr
        assert set(np.asarray(json.loads(done.stdout)["vectors"]).ravel().tolist()) == {value}, flags


def test_a_write_naming_no_version_lands_where_a_read_naming_none_reads(http: httpx.Client) -> None:
    """Before: a put without ``?model_version`` went to the model as configured while the read without one read
    the version production names, so the row just put was not what the next read answered."""
    _fill(http, 1.0)
    assert http.post("/v1/models/demo/versions", json={"version": 1}, headers=AUTH).status_code == 201
    _fill(http, 2.0, 1)
    assert http.put("/v1/models/demo/labels/production", json={"version": 1}, headers=AUTH).status_code == 200
    put = _put(http, 7.0, row_version=5)
    assert _read(http) == (1, {7.0})
    assert put.status_code == 200 and put.json()["model_version"] == 1, put.text
    assert _read(http, model_version="0") == (0, {1.0})  # the model as configured kept its rows
    deleted = http.request("DELETE", "/v1/models/demo/tables/item/embeddings", headers=AUTH,
                           json={"keys": [1, 2, 3]})
    assert deleted.json() == {"model_version": 1, "deleted": 3}
    assert _read(http) == (1, {0.0}) and _read(http, model_version="0") == (0, {1.0})


def test_a_put_says_what_it_wrote_and_what_was_stale_and_strict_refuses_a_stale_one(http: httpx.Client,
                                                                                    srv: HPSServer) -> None:
    """Before: a put with a stale row version answered ``200 {"written": 0}``, dropped without a word."""
    first = _put(http, 5.0, row_version=10)
    assert first.json() == {"model_version": 0, "written": KEYS.size, "stale": 0}
    stale = _put(http, 6.0, row_version=9)
    assert stale.status_code == 200 and stale.json() == {"model_version": 0, "written": 0, "stale": KEYS.size}
    assert _read(http) == (0, {5.0})
    mixed_keys = np.arange(KEYS[-1] - 3, KEYS[-1] + 5, dtype=np.int64)  # 4 stored at version 10, 4 new
    body = {"keys": mixed_keys.tolist(), "vectors": np.full((8, ITEM_DIM), 8.0).tolist(), "version": 9}
    mixed = http.put("/v1/models/demo/tables/item/embeddings", json=body, headers=AUTH)  # "version": the old name
    assert mixed.json() == {"model_version": 0, "written": 4, "stale": 4}
    strict = http.put("/v1/models/demo/tables/item/embeddings", params={"strict": "true"}, headers=AUTH,
                      json={**body, "keys": (mixed_keys + 100).tolist()[:4] + KEYS.tolist()[:4], "version": 9})
    assert strict.status_code == 409, strict.text
    assert "4 of 8 rows are older than the rows stored" in strict.json()["detail"]
    assert srv.engine is not None
    assert srv.engine.persistent.get("demo.item", mixed_keys[:4] + 100).found.sum() == 0  # nothing was written
    fresh = _put(http, 9.0, row_version=11, strict="true")
    assert fresh.json() == {"model_version": 0, "written": KEYS.size, "stale": 0}
    deleted = http.request("DELETE", "/v1/models/demo/tables/item/embeddings", headers=AUTH,
                           json={"keys": [1], "row_version": 20})
    assert deleted.json() == {"model_version": 0, "deleted": 1}
    assert _put(http, 1.0, row_version=20, strict="true").status_code == 409  # a tombstone as new refuses it
