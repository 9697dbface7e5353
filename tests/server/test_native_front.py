"""``server.front: native`` (issue 52): a node whose workers' port is served by pygrpc-native answers Lookup byte for
byte as a grpcio node does (rows, sources, versions, request ids, every refusal with its code and message; no retry
pushback trailer, which the front may not send), checks read tokens and deadlines, passes every other method (StreamLookup, ListModels, health, reflection)
to the grpcio server behind it, counts its calls, and drains on SIGTERM. The config refuses, by name, every setting
the front cannot honour."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hps_service.config import ConfigError, load_config
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.helpers import ServerProcess, free_port, write_config

pytest.importorskip("pygrpc_native")

DIM, READ_TOKEN = 8, "native-front-reader-token"
KEYS = np.arange(1, 2001, dtype=np.int64)
LOOKUP = "/hps.v1.EmbeddingService/Lookup"


def _node(tmp: Path, front: str, db: Path) -> ServerProcess:
    port = free_port()
    cfg = write_config(tmp / f"{front}.yaml", {
        "server": {"grpc_port": port, "http_port": free_port(), "workers": 2, "front": front, "max_batch_keys": 4096,
                   "max_connection_age_s": 0, "auth": "token",
                   "readers": [{"name": "reader", "token": READ_TOKEN, "models": ["m"]}]},
        "volatile": {"type": "hashmap", "capacity_rows": 10_000},
        "persistent": {"type": "rocksdb", "path": str(db), "block_cache_mb": 8, "read_only": True},
        "models": [{"name": "m", "tables": [{"name": "t", "dim": DIM, "default": {"constant": -1.0}},
                                            {"name": "u", "dim": 4}]}],
    })
    return ServerProcess(cfg, port).start(timeout=120)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("front")
    db = tmp / "db"
    tier = RocksDBTier(db, block_cache_mb=8)
    for name, dim in (("t", DIM), ("u", 4)):
        tier.create_table(f"m.{name}", dim)
        tier.bulk_import(f"m.{name}", KEYS, np.repeat(KEYS[:, None].astype(np.float32), dim, axis=1), version=3)
    tier.close()
    grpcio, native = _node(tmp, "grpcio", db), _node(tmp, "native", db)
    try:
        yield grpcio, native
    finally:
        assert native.stop() == 0, native.log()[-3000:]  # drained on SIGTERM
        grpcio.stop()


def _call(target: str, request: bytes, token: str | None = READ_TOKEN, timeout: float = 30
          ) -> tuple[str, bytes | str, tuple]:
    """(status, response bytes or message, trailing metadata) of one raw Lookup."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(LOOKUP)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            response, rpc = call.with_call(request, timeout=timeout, metadata=metadata)
            return "OK", response, tuple(rpc.trailing_metadata() or ())
        except grpc.RpcError as err:
            return err.code().name, err.details(), tuple(m for m in err.trailing_metadata() or () if m[0] != "date")


def _requests() -> list[bytes]:
    def table(name: str, keys: np.ndarray) -> pb.TableKeys:
        return pb.TableKeys(table=name, keys=keys.astype("<i8").tobytes())

    rng = np.random.default_rng(52)
    asked = np.concatenate([rng.choice(KEYS, 500), [0, -(2**63), 2**63 - 1, 5000], KEYS[:7]])
    return [r.SerializeToString() if isinstance(r, pb.LookupRequest) else r for r in (
        pb.LookupRequest(model="m", tables=[table("t", asked)], request_id=77),
        pb.LookupRequest(model="m", tables=[table("t", asked[:9]), table("u", asked[9:40])]),
        pb.LookupRequest(model="m", tables=[table("t", asked)], precision=pb.PRECISION_STORED),
        pb.LookupRequest(model="m", tables=[table("t", asked)], version=0),
        pb.LookupRequest(model="nope", tables=[table("t", asked)]),
        pb.LookupRequest(model="m", tables=[table("t", np.arange(5000, dtype=np.int64))]),
        pb.LookupRequest(model="m", tables=[pb.TableKeys(table="t", keys=b"\x01\x02\x03")]),
        pb.LookupRequest(model="m"),
        pb.LookupRequest(model="m", tables=[table("t", asked[:4]), table("t", asked[:4])], label="nolabel"),
        b"\xff\xff\xff",
    )]


def test_lookups_answer_byte_for_byte_as_under_grpcio(nodes: tuple[ServerProcess, ServerProcess]) -> None:
    grpcio, native = nodes
    statuses = set()
    for request in _requests():
        for _ in range(2):  # each of two workers, likely
            theirs, mine = _call(grpcio.target, request), _call(native.target, request)
            if theirs[0] == "RESOURCE_EXHAUSTED":  # the one difference: no retry pushback, a key the front reserves
                assert theirs[2] == (("grpc-retry-pushback-ms", "-1"),) and mine[2] == ()
                mine, theirs = mine[:2], theirs[:2]
            assert mine == theirs, (request[:40], mine[0], theirs[0])
            statuses.add(mine[0])
    assert statuses >= {"OK", "NOT_FOUND", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}, statuses
    request = _requests()[0]
    assert _call(native.target, request, token=None) == _call(grpcio.target, request, token=None)
    assert _call(native.target, request, token=None)[0] == "UNAUTHENTICATED"
    assert _call(native.target, request, token="x" * 20)[0] == "UNAUTHENTICATED"


def test_a_deadline_already_passed_is_refused(nodes: tuple[ServerProcess, ServerProcess]) -> None:
    _, native = nodes
    status, _, _ = _call(native.target, _requests()[0], timeout=0.0001)
    assert status == "DEADLINE_EXCEEDED"


def test_other_methods_pass_to_the_grpcio_server_behind_it(nodes: tuple[ServerProcess, ServerProcess]) -> None:
    _, native = nodes
    auth = (("authorization", f"Bearer {READ_TOKEN}"),)
    with grpc.insecure_channel(native.target) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        assert [m.name for m in stub.ListModels(pb.ListModelsRequest(), metadata=auth).models] == ["m"]
        assert stub.GetModel(pb.GetModelRequest(model="m"), metadata=auth).tables[0].dim == DIM
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        requests = [pb.LookupRequest(model="m", tables=[pb.TableKeys(table="t", keys=KEYS[:3].astype("<i8")
                                                                     .tobytes())], request_id=i) for i in range(3)]
        answers = list(stub.StreamLookup(iter(requests), metadata=auth))
        assert [a.request_id for a in answers] == [0, 1, 2]
        assert np.frombuffer(answers[1].tables[0].vectors, "<f4")[::DIM].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(("server", "named"), [
    ({"tls": {"cert_file": "c.pem", "key_file": "k.pem"}}, "server.tls"),
    ({"max_connection_age_s": 300}, "server.max_connection_age_s"),
    ({"tracing": {"enabled": True}}, "server.tracing.enabled"),
    ({"workers": 0}, "server.workers 0"),
    ({"min_client_ping_interval_s": 5}, "server.min_client_ping_interval_s"),
    ({"max_concurrent_requests": 64}, "server.max_concurrent_requests"),
    ({"max_connection_age_grace_s": 5}, "server.max_connection_age_grace_s"),
])
def test_what_the_native_front_cannot_honour_is_refused_by_name(server: dict, named: str) -> None:
    settings = {"front": "native", "max_connection_age_s": 0, **server}
    with pytest.raises(ConfigError, match=f"server.front native cannot honour {named}"):
        load_config(None, server=settings)
    assert load_config(None, server={"front": "native", "max_connection_age_s": 0}).server.front == "native"
    assert load_config(None).server.front == "grpcio"
