"""Hypothesis fuzz of the gRPC API of a real `hps serve` process: random key bytes, empty and oversized batches,
unknown names, many tables per request, raw bytes that are no protobuf, oversized messages, and requests exactly at
and one past each limit (keys, tables, message bytes). Every answer is OK or a client error (never INTERNAL/UNKNOWN),
the server keeps serving, and its memory stays bounded. The server runs the default ``cache.enabled: auto`` (no L1
on a CPU) over tables whose stored rows (some keys, the int64 edges among them) all fit the hash map: lookups go
through the compiled pass and the complete state (issue 52), and every row answered is the key's stored row or the
default, whatever the key bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.faults.support import rss_bytes
from tests.helpers import ServerProcess, free_port, write_config

MAX_KEYS = 4096
MAX_TABLES = 8
MAX_MESSAGE = 256 << 10
DIMS = {"item": 16, "user": 4}
#: Keys with a stored row in both tables: some small ones and the int64 edges.
STORED = np.concatenate([np.arange(-300, 300, dtype=np.int64), [-(2**63), -(2**63) + 1, 2**63 - 2, 2**63 - 1]])


def stored_rows(keys: np.ndarray, dim: int) -> np.ndarray:
    """The row stored for each key: its low bits and the column, never all zeros (the default)."""
    return ((keys % 997).astype(np.float32)[:, None] + 1000.0 + np.arange(dim, dtype=np.float32)[None, :])
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Fuzzed:
    """The running server and a channel to it."""

    def __init__(self, server: ServerProcess, http_port: int) -> None:
        self.server = server
        self.http = f"http://127.0.0.1:{http_port}"
        self.channel = grpc.insecure_channel(
            server.target, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        )
        self.stub = pb_grpc.EmbeddingServiceStub(self.channel)
        self.raw_lookup = self.channel.unary_unary("/hps.v1.EmbeddingService/Lookup")
        self.codes: dict[str, int] = {}

    def record(self, code: grpc.StatusCode) -> None:
        self.codes[code.name] = self.codes.get(code.name, 0) + 1


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    grpc_port, http_port = free_port(), free_port()
    db = RocksDBTier(tmp / "db", block_cache_mb=8)
    for name, dim in DIMS.items():
        db.create_table(f"demo.{name}", dim)
        db.bulk_import(f"demo.{name}", STORED, stored_rows(STORED, dim), version=1)
    db.close()
    cfg = write_config(tmp / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "workers": 2, "max_batch_keys": MAX_KEYS,
                   "max_tables_per_request": MAX_TABLES, "max_message_bytes": MAX_MESSAGE},
        "cache": {"backend": "numpy", "capacity": 2048},
        "volatile": {"type": "hashmap", "capacity_rows": 100_000},
        "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": n, "dim": d} for n, d in DIMS.items()]}],
    })
    with ServerProcess(cfg, grpc_port) as server:
        f = Fuzzed(server, http_port)
        yield f
        f.channel.close()
        print(f"\ngRPC fuzz status codes: {f.codes}")


def _check_answer(request: pb.LookupRequest, response: pb.LookupResponse) -> None:
    assert [t.table for t in response.tables] == [t.table for t in request.tables]
    for asked, answer in zip(request.tables, response.tables, strict=True):
        n = len(asked.keys) // 8
        assert answer.count == n and answer.dim == DIMS[asked.table]
        assert len(answer.vectors) == n * answer.dim * 4 and len(answer.sources) == n
        keys = np.frombuffer(asked.keys, dtype="<i8")
        rows = np.frombuffer(answer.vectors, dtype="<f4").reshape(n, answer.dim)
        sources = np.frombuffer(answer.sources, dtype=np.uint8)
        held = np.isin(keys, STORED)
        np.testing.assert_array_equal(rows[held], stored_rows(keys[held], answer.dim))
        assert not rows[~held].any() and (sources[~held] == 4).all() and np.isin(sources[held], (2, 3)).all()


names = st.one_of(st.just("demo"), st.sampled_from(["demo", "item", ""]), st.text(max_size=70))
tables = st.builds(
    pb.TableKeys,
    table=st.one_of(st.sampled_from(list(DIMS)), st.text(max_size=70)),
    keys=st.one_of(st.binary(max_size=4096), st.binary(max_size=512).map(lambda b: b[: len(b) // 8 * 8]),
                   st.integers(0, MAX_KEYS + 64).map(
        lambda n: np.random.default_rng(n).integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64).tobytes())),
)
well_formed_tables = st.builds(
    pb.TableKeys,
    table=st.sampled_from(list(DIMS)),
    keys=st.one_of(st.binary(max_size=2048).map(lambda b: b[: len(b) // 8 * 8]),
                   st.lists(st.one_of(st.sampled_from(STORED.tolist()), st.integers(-(2**63), 2**63 - 1)),
                            max_size=600).map(lambda ks: np.array(ks, dtype="<i8").tobytes())),
)
requests = st.one_of(
    st.builds(pb.LookupRequest, model=names, tables=st.lists(tables, max_size=MAX_TABLES + 4),
              request_id=st.integers(0, 2**64 - 1)),
    st.builds(pb.LookupRequest, model=st.just("demo"), tables=st.lists(well_formed_tables, min_size=1, max_size=6),
              request_id=st.integers(0, 2**64 - 1)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
def test_lookup_answers_or_refuses_cleanly(fuzzed: Fuzzed, request: pb.LookupRequest) -> None:
    try:
        response = fuzzed.stub.Lookup(request, timeout=30)
    except grpc.RpcError as err:
        fuzzed.record(err.code())
        assert err.code() in CLIENT_ERRORS, f"{err.code().name}: {err.details()}"
        assert err.details()
        return
    fuzzed.record(grpc.StatusCode.OK)
    _check_answer(request, response)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=512))
def test_raw_bytes_are_refused_as_invalid(fuzzed: Fuzzed, payload: bytes) -> None:
    try:
        response = fuzzed.raw_lookup(payload, timeout=30)
    except grpc.RpcError as err:
        fuzzed.record(err.code())
        assert err.code() in CLIENT_ERRORS, f"{err.code().name}: {err.details()}"
        return
    fuzzed.record(grpc.StatusCode.OK)
    request = pb.LookupRequest.FromString(payload)
    _check_answer(request, pb.LookupResponse.FromString(response))


def test_limits_and_memory(fuzzed: Fuzzed) -> None:
    """Over-limit batches, tables and messages (server.max_message_bytes) are RESOURCE_EXHAUSTED; the server's
    RSS stays bounded under repetition."""
    assert fuzzed.server.proc is not None
    pid = fuzzed.server.proc.pid
    too_many_keys = pb.LookupRequest(model="demo", tables=[
        pb.TableKeys(table="item", keys=np.arange(MAX_KEYS + 1, dtype="<i8").tobytes())])
    too_many_tables = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item")] * (MAX_TABLES + 1))
    oversized = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=b"\0" * (MAX_MESSAGE + 8))])
    far_over = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=b"\0" * (64 << 20))])
    largest_ok = pb.LookupRequest(model="demo", tables=[
        pb.TableKeys(table="item", keys=np.arange(MAX_KEYS, dtype="<i8").tobytes())])
    samples = []
    for round_ in range(14):
        for request in (too_many_keys, too_many_tables, oversized, far_over):
            with pytest.raises(grpc.RpcError) as info:
                fuzzed.stub.Lookup(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            if request is oversized or request is far_over:  # refused by the transport before it is parsed
                assert "larger than max" in info.value.details(), info.value.details()
        assert fuzzed.stub.Lookup(largest_ok, timeout=30).tables[0].count == MAX_KEYS
        if round_ >= 4:
            samples.append(rss_bytes(pid))
    growth = samples[-1] - samples[0]
    print(f"\nserver RSS over 10 rounds of 64 MiB refusals: {samples[0] / 2**20:.0f} -> {samples[-1] / 2**20:.0f} MiB")
    assert growth < 64 << 20, f"RSS grew by {growth / 2**20:.0f} MiB"
    assert fuzzed.server.proc.poll() is None


def _sized(total: int) -> pb.LookupRequest:
    """A request of exactly ``total`` serialized bytes: one table of whole int64 keys, the model name padding the
    rest (the batch limit refuses it before the name is looked at)."""
    for pad in range(64):
        keys = (total - pad - 16) // 8 * 8
        request = pb.LookupRequest(model="demo" + "x" * pad, tables=[pb.TableKeys(table="item", keys=b"\0" * keys)])
        if request.ByteSize() == total:
            return request
    raise AssertionError(f"no request of {total} bytes")


def test_requests_at_and_one_past_each_limit(fuzzed: Fuzzed) -> None:
    """At a limit the request is taken (or refused by the next limit inside, naming it); one past, refused naming
    the limit it broke: keys (server.max_batch_keys), tables (server.max_tables_per_request), bytes
    (server.max_message_bytes, refused by the transport before parsing)."""
    def keys(n: int) -> pb.TableKeys:
        return pb.TableKeys(table="item", keys=np.arange(n, dtype="<i8").tobytes())

    at_keys = pb.LookupRequest(model="demo", tables=[keys(MAX_KEYS)])
    assert fuzzed.stub.Lookup(at_keys, timeout=30).tables[0].count == MAX_KEYS
    at_tables = pb.LookupRequest(model="demo", tables=[keys(MAX_KEYS // MAX_TABLES)] * MAX_TABLES)
    assert [t.count for t in fuzzed.stub.Lookup(at_tables, timeout=30).tables] == [MAX_KEYS // MAX_TABLES] * MAX_TABLES
    over = {
        "max_batch_keys": pb.LookupRequest(model="demo", tables=[keys(MAX_KEYS // 2), keys(MAX_KEYS // 2 + 1)]),
        "max_tables_per_request": pb.LookupRequest(model="demo", tables=[keys(1)] * (MAX_TABLES + 1)),
        # exactly max_message_bytes passes the transport, and its 32k keys are over the batch limit
        "max_batch_keys=": _sized(MAX_MESSAGE),
        "larger than max": _sized(MAX_MESSAGE + 1),
    }
    for limit, request in over.items():
        with pytest.raises(grpc.RpcError) as refused:
            fuzzed.stub.Lookup(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        assert limit in refused.value.details(), (limit, refused.value.details())


def test_the_tables_were_complete_without_l1(fuzzed: Fuzzed) -> None:
    """What the fuzz above read through: the compiled pass (no L1) over complete tables."""
    import httpx

    tables = httpx.get(f"{fuzzed.http}/v1/stats", timeout=30).json()["models"]["demo"]["tables"]
    for name in DIMS:
        assert not tables[name]["cache"]["enabled"] and tables[name]["volatile"]["complete"] == 1, tables[name]
