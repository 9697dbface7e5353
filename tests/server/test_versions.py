"""Model versions and labels through REST and gRPC against a real in-process server: versions side by side, label
switches and rollback, retention, refusals, and a restart that keeps them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_client import AsyncHPSClient, HPSClient
from hps_client.errors import NotFoundError
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from tests.server.conftest import AUTH, ITEM_DIM, USER_DIM, base_url, running, server_config, target

KEYS = np.arange(1, 65, dtype=np.int64)


def _put(http: httpx.Client, value: float, version: int = 0, table: str = "item", dim: int = ITEM_DIM) -> None:
    r = http.put(f"/v1/models/demo/tables/{table}/embeddings", params={"model_version": version} if version else {},
                 json={"keys": KEYS.tolist(), "vectors": np.full((len(KEYS), dim), value).tolist(), "version": 1},
                 headers=AUTH)
    assert r.status_code == 200, r.text


def _lookup(stub: pb_grpc.EmbeddingServiceStub, version: int | None = None, label: str = "",
            tables: tuple[str, ...] = ("item",)) -> pb.LookupResponse:
    request = pb.LookupRequest(model="demo", label=label, tables=[
        pb.TableKeys(table=t, keys=KEYS.astype("<i8").tobytes()) for t in tables])
    if version is not None:  # the field has presence: 0 names the model as configured
        request.version = version
    return stub.Lookup(request, timeout=10)


def _value(response: pb.LookupResponse, i: int = 0) -> set[float]:
    return set(np.frombuffer(response.tables[i].vectors, dtype="<f4").tolist())


def _add(http: httpx.Client, version: int) -> httpx.Response:
    return http.post("/v1/models/demo/versions", json={"version": version}, headers=AUTH)


def _label(http: httpx.Client, label: str, version: int, allow_empty: bool = True) -> httpx.Response:
    """A switch that does not mind tables without rows (the refusal of those is tests/server/test_rollout_states.py's)."""
    return http.put(f"/v1/models/demo/labels/{label}", json={"version": version, "allow_empty": allow_empty},
                    headers=AUTH)


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[HPSServer]:
    with running(server_config(tmp_path, workers=0)) as s:
        yield s


@pytest.fixture
def http(srv: HPSServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url(srv), timeout=30) as client:
        yield client


@pytest.fixture
def stub(srv: HPSServer) -> Iterator[pb_grpc.EmbeddingServiceStub]:
    with grpc.insecure_channel(target(srv)) as channel:
        yield pb_grpc.EmbeddingServiceStub(channel)


def test_versions_side_by_side_labels_and_rollback(srv: HPSServer, http: httpx.Client,
                                                   stub: pb_grpc.EmbeddingServiceStub) -> None:
    _put(http, 1.0)
    for version, value in ((1, 2.0), (2, 3.0)):
        r = _add(http, version)
        assert r.status_code == 201, r.text
        _put(http, value, version)
        _put(http, value + 0.5, version, table="user", dim=USER_DIM)
    # each version answers its own rows; a request naming none reads the model as configured
    answer = _lookup(stub)
    assert _value(answer) == {1.0} and answer.version == 0
    for version, value in ((1, 2.0), (2, 3.0)):
        answer = _lookup(stub, version=version)
        assert _value(answer) == {value} and answer.version == version
    # a label switch moves every request that names no version; both tables of one request from one version
    assert _label(http, "production", 2).json()["before"] is None
    answer = _lookup(stub, tables=("item", "user"))
    assert answer.version == 2 and _value(answer, 0) == {3.0} and _value(answer, 1) == {3.5}
    r = _label(http, "production", 1)  # rollback: immediate, no re-import
    assert r.status_code == 200 and r.json()["before"] == 2
    assert _value(_lookup(stub)) == {2.0} and _lookup(stub).version == 1
    assert _label(http, "canary", 2).status_code == 200
    assert _lookup(stub, label="canary").version == 2
    # REST reads follow the same rules
    rows = http.get("/v1/models/demo/tables/item/embeddings", params={"keys": "1,2", "label": "canary"}).json()
    assert rows["version"] == 2 and rows["vectors"][0][0] == 3.0
    assert http.get("/v1/models/demo/tables/item/embeddings", params={"keys": "1"}).json()["version"] == 1
    # visible in /v1/models and in metrics
    model = http.get("/v1/models/demo").json()
    assert model["versions"] == [1, 2] and model["labels"] == {"production": 1, "canary": 2}
    assert model["default_version"] == 1
    listed = http.get("/v1/models/demo/versions").json()
    assert [(v["version"], v["labels"]) for v in listed["versions"]] == [(1, ["production"]), (2, ["canary"])]
    metrics = http.get("/metrics").text
    assert 'hps_model_label_version{label="production",model="demo"} 1.0' in metrics
    # version 0 named explicitly is the model as configured, whatever the labels say
    answer = _lookup(stub, version=0)
    assert _value(answer) == {1.0} and answer.version == 0
    with HPSClient(target(srv)) as client:
        assert set(client.lookup("demo", "item", KEYS, version=0).ravel().tolist()) == {1.0}
        assert set(client.lookup("demo", "item", KEYS).ravel().tolist()) == {2.0}
    # label 0 names the model as configured
    assert _label(http, "production", 0).status_code == 200
    assert _value(_lookup(stub)) == {1.0}
    assert http.delete("/v1/models/demo/labels/canary", headers=AUTH).status_code == 200
    with pytest.raises(grpc.RpcError) as err:
        _lookup(stub, label="canary")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no label 'canary'" in err.value.details()


def test_refusals_name_the_problem(http: httpx.Client, stub: pb_grpc.EmbeddingServiceStub) -> None:
    assert _add(http, 1).status_code == 201
    cases = [
        (dict(version=7), grpc.StatusCode.NOT_FOUND, "has no version 7"),
        (dict(label="nope"), grpc.StatusCode.NOT_FOUND, "has no label 'nope'"),
        (dict(version=1, label="x"), grpc.StatusCode.INVALID_ARGUMENT, "name one"),
        (dict(label="bad label!"), grpc.StatusCode.INVALID_ARGUMENT, "is not a name"),
    ]
    for kwargs, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            _lookup(stub, **kwargs)  # type: ignore[arg-type]
        assert err.value.code() == code and text in err.value.details(), kwargs
    assert _add(http, 1).status_code == 409
    assert http.post("/v1/models/nope/versions", json={"version": 1}, headers=AUTH).status_code == 404
    assert http.post("/v1/models/demo/versions", json={"version": 0}, headers=AUTH).status_code == 422
    no_tables = http.post("/v1/models/demo/versions", json={"version": 3, "tables": []}, headers=AUTH)
    assert no_tables.status_code == 422 and "tables" in no_tables.json()["detail"]  # was a 500 (schemathesis)
    twice = http.post("/v1/models/demo/versions", headers=AUTH, json={"version": 3, "tables": [
        {"name": "item", "dim": 4}, {"name": "item", "dim": 8}]})
    assert twice.status_code == 422 and "duplicate table name(s): item" in twice.json()["detail"]  # was a 500 too
    assert http.post("/v1/models/demo/versions", json={"version": 3}).status_code == 401
    missing = _label(http, "production", 9)
    assert missing.status_code == 409 and "no version 9" in missing.json()["detail"]
    assert _label(http, "bad label", 1).status_code in (400, 422)
    assert _label(http, "production", 1).status_code == 200
    labelled = http.delete("/v1/models/demo/versions/1", headers=AUTH)
    assert labelled.status_code == 409 and "labelled (production)" in labelled.json()["detail"]
    assert http.delete("/v1/models/demo/versions/0", headers=AUTH).status_code == 422
    assert http.delete("/v1/models/demo/versions/5", headers=AUTH).status_code == 404
    assert http.delete("/v1/models/demo/labels/nope", headers=AUTH).status_code == 404
    put = http.put("/v1/models/demo/tables/item/embeddings", params={"model_version": 4}, headers=AUTH,
                   json={"keys": [1], "vectors": [[0.0] * ITEM_DIM]})
    assert put.status_code == 404 and "no version 4" in put.json()["detail"]


def test_retention_drops_old_unlabelled_versions_and_frees_their_rows(srv: HPSServer, http: httpx.Client,
                                                                      stub: pb_grpc.EmbeddingServiceStub) -> None:
    engine = srv.engine
    assert engine is not None
    for version in (1, 2, 3):
        assert _add(http, version).status_code == 201
        _put(http, float(version), version)
    # keep_versions 2 (the default), the new one counted: adding 3 dropped 1
    assert [v.version for v in engine.versions("demo")] == [2, 3]
    assert _label(http, "production", 2).status_code == 200
    assert engine.persistent.count("demo#v3.item") == len(KEYS)
    for version in (4, 5):
        assert _add(http, version).status_code == 201
    # 2 is labelled, so it stays; of the unlabelled 3, 4 and 5 the newest two stay
    assert [v.version for v in engine.versions("demo")] == [2, 4, 5]
    for tier in (engine.persistent, engine.volatile):
        assert tier is not None
        with pytest.raises(Exception, match="no table|does not exist"):
            tier.count("demo#v3.item")
    assert _value(_lookup(stub)) == {2.0}
    with pytest.raises(grpc.RpcError) as err:
        _lookup(stub, version=3)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    dropped = http.delete("/v1/models/demo/versions/4", headers=AUTH)
    assert dropped.status_code == 200 and [v.version for v in engine.versions("demo")] == [2, 5]


def test_a_restart_serves_the_same_versions_and_labels(tmp_path: Path) -> None:
    config = server_config(tmp_path, workers=0)
    with running(config) as s, httpx.Client(base_url=base_url(s), timeout=30) as http:
        assert _add(http, 3).status_code == 201
        _put(http, 3.0, 3)
        assert _label(http, "production", 3).status_code == 200
    with running(config) as s, grpc.insecure_channel(target(s)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        answer = _lookup(stub)
        assert answer.version == 3 and _value(answer) == {3.0}
        assert [v.version for v in s.engine.versions("demo")] == [3]


def test_the_clients_name_a_version_or_a_label(srv: HPSServer, http: httpx.Client) -> None:
    _put(http, 1.0)
    assert _add(http, 1).status_code == 201
    _put(http, 2.0, 1)
    assert _label(http, "canary", 1).status_code == 200
    with HPSClient(target(srv)) as client:
        assert set(client.lookup("demo", "item", KEYS).ravel().tolist()) == {1.0}
        assert set(client.lookup("demo", "item", KEYS, version=1).ravel().tolist()) == {2.0}
        answers = client.lookup_many("demo", {"item": KEYS, "user": KEYS}, label="canary")
        assert set(answers["item"].vectors.ravel().tolist()) == {2.0}
        with pytest.raises(NotFoundError, match="no version 5"):
            client.lookup("demo", "item", KEYS, version=5)

    async def aio() -> np.ndarray:
        async with AsyncHPSClient(target(srv)) as client:
            return await client.lookup("demo", "item", KEYS, label="canary")

    assert set(asyncio.run(aio()).ravel().tolist()) == {2.0}


def test_the_limits_of_versions_and_labels_hold_at_and_past_each(http: httpx.Client,
                                                                   stub: pb_grpc.EmbeddingServiceStub) -> None:
    """A label of 64 characters is a name and one of 65 is not; version numbers stop at 2**31 - 1 (REST) and a lookup
    of any uint32 version that is not loaded is NOT_FOUND; the routes' bodies are bounded before they are read."""
    from hps_service.server.rest_access import MODEL_BODY_BYTES, SMALL_BODY_BYTES

    top = 2**31 - 1
    assert _add(http, top).status_code == 201
    assert _add(http, top + 1).status_code == 422
    longest, too_long = "l" * 64, "l" * 65
    assert _label(http, longest, top).status_code == 200
    refused = _label(http, too_long, top)
    assert refused.status_code in (400, 422) and "is not a name of 1-64" in refused.json()["detail"]
    assert _label(http, "production", top + 1).status_code == 422
    assert http.delete(f"/v1/models/demo/versions/{top + 1}", headers=AUTH).status_code == 422
    assert _lookup(stub, label=longest).version == top
    for kwargs, code, text in ((dict(label=too_long), grpc.StatusCode.INVALID_ARGUMENT, "is not a name"),
                               (dict(version=2**32 - 1), grpc.StatusCode.NOT_FOUND, "has no version 4294967295")):
        with pytest.raises(grpc.RpcError) as err:
            _lookup(stub, **kwargs)  # type: ignore[arg-type]
        assert err.value.code() == code and text in err.value.details(), kwargs
    for path, limit, method in ((f"/v1/models/demo/labels/{longest}", SMALL_BODY_BYTES, "PUT"),
                                ("/v1/models/demo/versions", MODEL_BODY_BYTES, "POST")):
        body = b'{"version": 1' + b" " * limit + b"}"
        big = http.request(method, path, content=body, headers={**AUTH, "content-type": "application/json"})
        assert big.status_code == 413 and "exceeds" in big.json()["detail"], (path, big.text[:200])
    assert http.delete(f"/v1/models/demo/labels/{longest}", headers=AUTH).status_code == 200
    assert http.delete(f"/v1/models/demo/versions/{top}", headers=AUTH).status_code == 200


def test_a_drop_interrupted_half_way_is_finished_by_the_restart(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop after a version's first table was freed (the process died there) leaves the version's drop marked and
    its registration stored: the restart finishes the drop instead of serving the version with that table empty,
    and the version added again later has none of the old rows."""
    from hps_service.engine import registry, version_drop

    config = server_config(tmp_path, workers=0)
    real = registry.drop_stored_ids

    def dies_after_the_first(volatile, persistent, tables, names):  # type: ignore[no-untyped-def]
        first = dict(list(sorted(tables.items()))[:1])
        real(volatile, persistent, first, names)
        raise RuntimeError("the process died here")

    with running(config) as s, httpx.Client(base_url=base_url(s), timeout=30) as http:
        assert _add(http, 1).status_code == 201
        _put(http, 5.0, 1)
        _put(http, 5.0, 1, table="user", dim=USER_DIM)
        monkeypatch.setattr(registry, "drop_stored_ids", dies_after_the_first)
        assert http.delete("/v1/models/demo/versions/1", headers=AUTH).status_code == 500
        monkeypatch.setattr(registry, "drop_stored_ids", real)
        assert s.engine is not None
        assert set(version_drop.pending(s.engine.persistent)) == {"demo#v1"}
        assert s.engine.persistent.count("demo#v1.user") == len(KEYS)  # the second table was not freed
    with running(config) as s, httpx.Client(base_url=base_url(s), timeout=30) as http:
        engine = s.engine
        assert engine is not None
        assert [v.version for v in engine.versions("demo")] == []
        assert version_drop.pending(engine.persistent) == {}
        with pytest.raises(Exception, match="no table|does not exist"):
            engine.persistent.count("demo#v1.user")
        assert _add(http, 1).status_code == 201  # the number again: a new version, none of the old rows
        with grpc.insecure_channel(target(s)) as channel:
            answer = _lookup(pb_grpc.EmbeddingServiceStub(channel), version=1, tables=("item", "user"))
        assert _value(answer, 0) == {0.0} and _value(answer, 1) == {0.5}
    with running(config) as s:  # and the finished drop stays finished
        assert s.engine is not None and [v.version for v in s.engine.versions("demo")] == [1]
