"""Lookups with ``precision = stored`` over real gRPC: the table's fp16, bf16 or int8 rows as stored, which decode to
exactly what a float32 lookup answers, in fewer bytes; on one server, several tables, a sharded fleet and asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_client import AsyncHPSClient, HPSClient, InvalidArgumentError, StoredAnswer
from hps_client.wire import build_request, decode_stored, parse_lookup_response
from hps_service.config import HPSConfig
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.rows import row_format
from hps_service.serve.process import HPSServer
from hps_service.updates.partitioning import shard_of
from tests.server.conftest import AUTH, base_url, running, server_config, target

#: (table, storage, dim): odd dims pad the 16-bit and 8-bit rows to a whole word.
TABLES = [("f32", "fp32", 8), ("h", "fp16", 7), ("b", "bf16", 8), ("q", "int8", 7)]
KEYS = np.arange(1, 401, dtype=np.int64) * 7919
ASK = np.concatenate((KEYS[::3], KEYS[:20], np.array([-5, 2**63 - 1], dtype=np.int64)))  # duplicates, absent keys
P = 8


def config(tmp: Path, shards: int = 1, shard: int = 0) -> HPSConfig:
    cfg = server_config(tmp)
    models = [cfg.models[0].model_copy(update={"tables": [
        cfg.models[0].tables[0].model_copy(update={"name": name, "storage": storage, "dim": dim})
        for name, storage, dim in TABLES]})]
    cluster = cfg.cluster.model_copy(update={"shards": shards, "shard": shard, "partitions": P})
    return cfg.model_copy(update={"models": models, "cluster": cluster})


def written(dim: int) -> np.ndarray:
    return (np.random.default_rng(dim).standard_normal((KEYS.size, dim)) * 3).astype(np.float32)


def fill(srv: HPSServer, shards: int = 1) -> None:
    own = shard_of(KEYS, P, shards) == srv.shard_map.shard
    for name, _, dim in TABLES:
        r = httpx.put(f"{base_url(srv)}/v1/models/demo/tables/{name}/embeddings", headers=AUTH, timeout=30,
                      json={"keys": KEYS[own].tolist(), "vectors": written(dim)[own].tolist(), "version": 1})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    with running(config(tmp_path_factory.mktemp("stored"))) as srv:
        fill(srv)
        yield srv


def check(answer: StoredAnswer, client: HPSClient, name: str, storage: str, dim: int) -> None:
    fp32 = client.lookup_with_sources("demo", name, ASK)
    assert answer.rows.storage == storage and answer.rows.dim == dim and len(answer.rows) == ASK.size
    np.testing.assert_array_equal(answer.rows.to_float32(), fp32.vectors)
    np.testing.assert_array_equal(answer.sources == 4, fp32.sources == 4)  # the levels move up as rows are read
    assert (answer.sources[:-2] != 4).all() and (answer.sources[-2:] == 4).all()
    assert answer.rows.nbytes == 4 * row_format(storage, dim).words * ASK.size


@pytest.mark.parametrize(("name", "storage", "dim"), TABLES)
def test_stored_rows_decode_to_the_float32_answer(server: HPSServer, name: str, storage: str, dim: int) -> None:
    with HPSClient(target(server)) as client:
        for _ in range(2):  # from the tiers, then from L1
            check(client.lookup_stored("demo", name, ASK), client, name, storage, dim)
        stored = client.lookup_stored("demo", name, ASK)
        if storage == "int8":  # the parts a GPU decoder reads: codes, and a scale and bias per row
            assert stored.rows.codes.shape == (ASK.size, dim) and stored.rows.scale.shape == (ASK.size,)
            np.testing.assert_array_equal(stored.rows.codes[:, :].min(axis=1)[stored.sources != 4], 0)
        elif storage != "fp32":
            assert stored.rows.halves.shape == (ASK.size, dim)


def test_stored_rows_take_fewer_bytes_on_the_wire(server: HPSServer) -> None:
    keys = KEYS[:256]
    sizes = {}
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        for name, _, _ in TABLES:
            sizes[name] = stub.Lookup(build_request("demo", {name: keys}, pb.PRECISION_STORED)).ByteSize()
        fp32_of_int8 = stub.Lookup(build_request("demo", {"q": keys})).ByteSize()
    assert sizes["h"] < 0.6 * sizes["f32"] and sizes["b"] < 0.6 * sizes["f32"]
    assert sizes["q"] < 0.6 * fp32_of_int8  # dim 7: 2 words of codes + scale and bias (16 B), against 28 B


def test_several_tables_in_one_stored_request(server: HPSServer) -> None:
    """The general (multi-table) path: each table's storage field and rows."""
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        request = build_request("demo", {name: ASK for name, _, _ in TABLES}, pb.PRECISION_STORED)
        raw = stub.Lookup.with_call(request)[0].SerializeToString()
    response = parse_lookup_response(raw)
    with HPSClient(target(server)) as client:
        for tv, (name, storage, dim) in zip(response.tables, TABLES):
            assert tv.table == name
            check(decode_stored(tv), client, name, storage, dim)


def test_an_unknown_precision_is_invalid_argument(server: HPSServer) -> None:
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        request = build_request("demo", {"q": KEYS[:3]})
        request.precision = 7  # proto3 enums are open: a newer client's value reaches the server
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "precision 7" in (err.value.details() or "")
    with HPSClient(target(server)) as client, pytest.raises(InvalidArgumentError):
        client.lookup_stored("demo", "q", np.array([1.5]))


def test_async_client_stored(server: HPSServer) -> None:
    async def run() -> StoredAnswer:
        async with AsyncHPSClient(target(server)) as client:
            return await client.lookup_stored("demo", "b", ASK)

    answer = asyncio.run(run())
    with HPSClient(target(server)) as client:
        check(answer, client, "b", "bf16", 8)


def test_a_sharded_fleet_merges_stored_rows_in_the_order_asked(tmp_path: Path) -> None:
    with ExitStack() as stack:
        servers = [stack.enter_context(running(config(tmp_path / f"s{s}", 2, s))) for s in (0, 1)]
        for srv in servers:
            fill(srv, 2)
        with HPSClient([target(s) for s in servers]) as client:
            assert len(set(shard_of(ASK, P, 2).tolist())) == 2
            for name, storage, dim in TABLES:
                check(client.lookup_stored("demo", name, ASK), client, name, storage, dim)
