"""A shard (cluster: {shards: 2, shard: 0}) answers only its keys: others are refused, loudly, naming their shard,
over gRPC (FAILED_PRECONDITION) and REST (421); GetClusterInfo and GET /v1/cluster describe the shard map; a REST
import keeps only the shard's rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_service.admin.importer import synthesize_model
from hps_service.config import HPSConfig
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from hps_service.updates.partitioning import shard_of
from tests.server.conftest import AUTH, ITEM_DIM, base_url, running, server_config, target, wait_job

P = 8
KEYS = np.arange(1, 201, dtype=np.int64) * 7919
OWNED = KEYS[shard_of(KEYS, P, 2) == 0]
FOREIGN = KEYS[shard_of(KEYS, P, 2) == 1]
ROWS = "/v1/models/demo/tables/item/embeddings"


def sharded_config(tmp: Path) -> HPSConfig:
    cfg = server_config(tmp)
    return cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"shards": 2, "shard": 0, "partitions": P})})


@pytest.fixture(scope="module")
def shard0(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    with running(sharded_config(tmp_path_factory.mktemp("shard0"))) as srv:
        yield srv


@pytest.fixture
def stub(shard0: HPSServer) -> Iterator[pb_grpc.EmbeddingServiceStub]:
    with grpc.insecure_channel(target(shard0)) as channel:
        yield pb_grpc.EmbeddingServiceStub(channel)


@pytest.fixture
def http(shard0: HPSServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url(shard0), timeout=30) as client:
        yield client


def _request(*tables: tuple[str, np.ndarray]) -> pb.LookupRequest:
    return pb.LookupRequest(model="demo", tables=[pb.TableKeys(table=t, keys=k.astype("<i8").tobytes())
                                                  for t, k in tables])


def test_keys_split_between_the_shards() -> None:
    assert 0.35 < OWNED.size / KEYS.size < 0.65


def test_grpc_answers_owned_keys_and_refuses_others_naming_their_shard(stub) -> None:
    response = stub.Lookup(_request(("item", OWNED)))
    assert response.tables[0].count == OWNED.size
    for request in (_request(("item", FOREIGN)), _request(("item", np.concatenate((OWNED, FOREIGN[:1])))),
                    _request(("item", OWNED), ("user", FOREIGN[:3]))):
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(request)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "shard 1 owns" in err.value.details() and "shard 0 of 2" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(_request(("item", FOREIGN[:2])))
    assert f"e.g. {FOREIGN[0]}, {FOREIGN[1]}" in err.value.details()


def test_cluster_info_over_grpc_and_rest(stub, http: httpx.Client) -> None:
    info = stub.GetClusterInfo(pb.GetClusterInfoRequest())
    assert (info.shards, info.shard, info.partitions, info.partitioner) == (2, 0, P, "murmur2")
    assert list(info.owned_partitions) == [0, 2, 4, 6]
    assert info.ready and not info.not_ready and dict(info.topic_partitions) == {}
    rest = http.get("/v1/cluster").json()
    assert rest == {"shards": 2, "shard": 0, "partitions": P, "partitioner": "murmur2",
                    "owned_partitions": [0, 2, 4, 6], "topic_partitions": {}, "ready": True, "not_ready": []}


def test_rest_rows_of_another_shard_are_refused_with_421(http: httpx.Client) -> None:
    vectors = np.ones((2, ITEM_DIM)).tolist()
    ok = http.put(ROWS, json={"keys": OWNED[:2].tolist(), "vectors": vectors, "version": 1}, headers=AUTH)
    assert ok.status_code == 200, ok.text
    got = http.get(ROWS, params={"keys": ",".join(map(str, OWNED[:2]))}).json()
    assert got["sources"] != ["default", "default"]
    for response in (
        http.get(ROWS, params={"keys": ",".join(map(str, FOREIGN[:2]))}),
        http.put(ROWS, json={"keys": [int(OWNED[0]), int(FOREIGN[0])], "vectors": vectors, "version": 2},
                 headers=AUTH),
        http.request("DELETE", ROWS, json={"keys": [int(FOREIGN[0])]}, headers=AUTH),
    ):
        assert response.status_code == 421, response.text
        assert "shard 1 owns" in response.json()["error"]
    assert http.get(ROWS, params={"keys": str(OWNED[0])}).json()["vectors"] == [vectors[0]]  # the refused put wrote nothing


def test_rest_import_keeps_only_this_shards_rows(http: httpx.Client, tmp_path: Path) -> None:
    keys, vectors = synthesize_model(2000, 4, seed=3)
    path = tmp_path / "user.npz"
    np.savez(path, keys=keys, vectors=vectors)
    job = http.post("/v1/models/demo/tables/user/import", json={"path": str(path), "version": 1}, headers=AUTH).json()
    view = wait_job(http, job["id"])
    assert view["state"] == "succeeded", view
    owned = shard_of(keys, P, 2) == 0
    assert view["result"]["rows_read"] == 2000
    assert view["result"]["rows_skipped_other_shards"] == int((~owned).sum())
    assert view["result"]["rows_stored"] == int(owned.sum())
    got = http.get("/v1/models/demo/tables/user/embeddings", params={"keys": ",".join(map(str, keys[owned][:5]))})
    np.testing.assert_allclose(got.json()["vectors"], vectors[owned][:5], rtol=1e-6)
