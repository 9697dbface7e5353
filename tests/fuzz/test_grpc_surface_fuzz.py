"""Hypothesis fuzz of every gRPC method of a real `hps serve` with two workers and read auth on: Lookup and
StreamLookup naming random versions, labels, precisions and tables; ListModels, GetModel and GetClusterInfo; health
Check and Watch; reflection; random metadata and credentials on each; bytes that are no message on every method; and
many idle calls of every kind at once. Every answer is well formed or a clear status (INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED), never INTERNAL or UNKNOWN, and no worker
dies. A few seconds of examples each; ``HPS_RUN_LONG=1`` runs ten times as many."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hps_client import ACCEPTING_SERVICE
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.helpers import ServerProcess, free_port, write_config

ADMIN, ALL, DEMO = "surface-admin-token-000001", "surface-all-models-token-1", "surface-demo-only-token-01"
READERS = {ALL: None, DEMO: {"demo"}, ADMIN: None}
DIMS = {"demo": {"item": 8, "user": 4}, "other": {"item": 4}}
CANARY = 2  # the version the label "canary" of demo names
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
EXAMPLES = 10 if os.environ.get("HPS_RUN_LONG", "") not in ("", "0") else 1
FUZZ = settings(max_examples=100 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Surface:
    """The server, a channel to it (one connection: the kernel hands it to one worker) and the codes seen."""

    def __init__(self, server: ServerProcess, http_port: int) -> None:
        self.server = server
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30,
                                 headers={"Authorization": f"Bearer {ADMIN}"})
        self.channels = [grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
                         for _ in range(4)]
        self.codes: dict[str, int] = {}
        self.workers = self.worker_pids()

    def stub(self, i: int = 0) -> pb_grpc.EmbeddingServiceStub:
        return pb_grpc.EmbeddingServiceStub(self.channels[i % len(self.channels)])

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.http.get("/v1/stats").json()["node"]["workers"]]

    def refused(self, err: grpc.RpcError, allowed: set[grpc.StatusCode] = CLEAR) -> grpc.StatusCode:
        """Record a refusal, which must be a clear status with a message."""
        code = err.code()
        self.codes[code.name] = self.codes.get(code.name, 0) + 1
        assert code in allowed, f"{code.name}: {err.details()}"
        assert err.details()
        return code

    def ok(self) -> None:
        self.codes["OK"] = self.codes.get("OK", 0) + 1

    def check_workers(self) -> None:
        """No worker died (a restarted one has another pid) and the node restarted none."""
        assert self.server.proc is not None and self.server.proc.poll() is None
        assert self.worker_pids() == self.workers
        assert self.http.get("/v1/stats").json()["node"]["restarts"] == 0


@pytest.fixture(scope="module")
def surface(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Surface]:
    tmp: Path = tmp_path_factory.mktemp("surface")
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "workers": 2, "grpc_workers": 2,
                   "admin_token": ADMIN, "auth": "token", "max_batch_keys": 512, "max_tables_per_request": 4,
                   "max_streams": 4, "readers": [{"name": "all", "token": ALL, "models": ["*"]},
                                                 {"name": "demo", "token": DEMO, "models": ["demo"]}]},
        "cache": {"backend": "numpy", "capacity": 1024},
        "volatile": {"type": "hashmap", "capacity_rows": 10_000},
        "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 8}, {"name": "user", "dim": 4,
                                                                           "storage": "int8"}]},
                   {"name": "other", "tables": [{"name": "item", "dim": 4}]}],
    })
    with ServerProcess(cfg, grpc_port) as server:
        s = Surface(server, http_port)
        rows = "/v1/models/demo/tables/item/embeddings"
        assert s.http.put(rows, json={"keys": [1, 2, 3], "vectors": [[0.5] * 8] * 3}).status_code == 200
        assert s.http.post("/v1/models/demo/versions", json={"version": CANARY}).status_code == 201
        assert s.http.put("/v1/models/demo/labels/canary", json={"version": CANARY, "allow_empty": True}).status_code == 200
        yield s
        s.check_workers()
        for channel in s.channels:
            channel.close()
        s.http.close()
        print(f"\ngRPC surface fuzz status codes: {s.codes}")


# ---- strategies ----------------------------------------------------------------------------------------------
printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
valid_tokens = st.sampled_from([ALL, DEMO, ADMIN])
tokens = st.one_of(valid_tokens, valid_tokens, valid_tokens, st.none(), st.just("not-a-token-of-anyone-0001"),
                   printable.map(lambda t: f"Bearer {t}"), printable)
metadata_keys = st.from_regex(r"x-[a-z0-9_.-]{1,16}", fullmatch=True)
extra_metadata = st.lists(st.one_of(
    st.tuples(metadata_keys, printable),
    st.tuples(metadata_keys.map(lambda k: k + "-bin"), st.binary(max_size=32)),
    st.tuples(st.just("x-request-id"), printable)), max_size=3)


def _metadata(token: str | None, extra: list[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    """The call's metadata: ``token`` as a bearer token (a known one) or as the header's whole value (any other)."""
    auth: list[tuple[str, Any]] = []
    if token is not None:
        auth = [("authorization", f"Bearer {token}" if token in READERS else token)]
    return tuple(auth + extra)


def _reader(metadata: tuple[tuple[str, Any], ...]) -> set[str] | None | bool:
    """The models the call's credential may read (None: all), or False when it names no reader."""
    for key, value in metadata:
        if key == "authorization" and value.startswith("Bearer ") and value[7:] in READERS:
            return READERS[value[7:]]
    return False


models = st.one_of(st.sampled_from(["demo", "other", "", "nope"]), printable)
key_lists = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)
plain_keys = st.builds(
    pb.TableKeys, table=st.one_of(st.sampled_from(["item", "user"]), printable),
    keys=st.one_of(key_lists.map(lambda ks: np.array(ks, dtype="<i8").tobytes()), st.binary(max_size=64)))


@st.composite
def pooled_keys(draw: st.DrawFn) -> pb.TableKeys:
    """A pooled table: keys in bags, valid often enough to be answered (sorted offsets from 0, weights with sum),
    or any offsets, combiner and weights bytes."""
    keys = draw(key_lists)
    n = len(keys)
    if draw(st.booleans()):
        offsets = np.sort(np.array(draw(st.lists(st.integers(0, n), max_size=12)) or [0], dtype="<i8"))
        offsets[0] = 0
        combiner = draw(st.sampled_from([pb.COMBINER_SUM, pb.COMBINER_MEAN]))
        weights = (np.array(draw(st.lists(st.floats(-4, 4, width=32), min_size=n, max_size=n)), dtype="<f4")
                   if combiner == pb.COMBINER_SUM and draw(st.booleans()) else np.zeros(0, "<f4"))
        return pb.TableKeys(table=draw(st.sampled_from(["item", "user"])), keys=np.array(keys, "<i8").tobytes(),
                            offsets=offsets.tobytes(), combiner=combiner, weights=weights.tobytes())
    return pb.TableKeys(table=draw(st.sampled_from(["item", "user"])), keys=np.array(keys, "<i8").tobytes(),
                        offsets=draw(st.binary(max_size=48)), combiner=draw(st.integers(0, 2**31 - 1)),
                        weights=draw(st.binary(max_size=48)))


table_keys = st.one_of(plain_keys, plain_keys, pooled_keys())
lookups = st.builds(
    lambda model, tables, version, label, precision, rid: pb.LookupRequest(
        model=model, tables=tables, label=label, precision=precision, request_id=rid,
        **({} if version is None else {"version": version})),
    models, st.lists(table_keys, max_size=5),
    st.one_of(st.none(), st.sampled_from([0, 1, CANARY, 3]), st.integers(0, 2**32 - 1)),
    st.one_of(st.sampled_from(["", "production", "canary", "nope"]), printable),
    st.one_of(st.sampled_from([0, 1]), st.integers(-(2**31), 2**31 - 1)), st.integers(0, 2**64 - 1))


def _check_answer(request: pb.LookupRequest, response: pb.LookupResponse) -> None:
    """An answer is the request's model, tables and id, each table its dim and count, at the version asked."""
    assert response.model == request.model and response.request_id == request.request_id
    assert [t.table for t in response.tables] == [t.table for t in request.tables]
    if request.HasField("version"):
        assert response.version == request.version
    elif request.label == "canary":
        assert response.version == CANARY
    for asked, answer in zip(request.tables, response.tables, strict=True):
        n = len(asked.offsets) // 8 if asked.combiner else len(asked.keys) // 8  # a pooled table: one row per bag
        assert answer.count == n and answer.dim == DIMS[request.model][asked.table] and len(answer.sources) == n
        assert answer.pooled == bool(asked.combiner)
        if request.precision == 0 or asked.combiner:
            assert len(answer.vectors) == n * answer.dim * 4
            assert np.isfinite(np.frombuffer(answer.vectors, dtype="<f4")).all()


def _expect_refused(surface: Surface, err: grpc.RpcError, metadata: tuple, model: str | None) -> None:
    """A refused call of the EmbeddingService: a call naming no reader is UNAUTHENTICATED, one naming a model its
    reader may not read PERMISSION_DENIED, whatever else is wrong with it."""
    code = surface.refused(err)
    reader = _reader(metadata)
    if reader is False:
        assert code == grpc.StatusCode.UNAUTHENTICATED, err.details()
    elif model and reader is not None and model not in reader:
        assert code == grpc.StatusCode.PERMISSION_DENIED, err.details()


# ---- the EmbeddingService ------------------------------------------------------------------------------------
@FUZZ
@given(request=lookups, token=tokens, extra=extra_metadata, i=st.integers(0, 3))
def test_lookups_answer_or_refuse_cleanly(surface: Surface, request: pb.LookupRequest, token: str | None,
                                          extra: list, i: int) -> None:
    metadata = _metadata(token, extra)
    try:
        response = surface.stub(i).Lookup(request, timeout=30, metadata=metadata)
    except grpc.RpcError as err:
        _expect_refused(surface, err, metadata, request.model)
        return
    surface.ok()
    assert _reader(metadata) is not False
    _check_answer(request, response)


@settings(FUZZ, max_examples=40 * EXAMPLES)
@given(requests=st.lists(lookups, min_size=1, max_size=4), token=tokens, i=st.integers(0, 3))
def test_streamed_lookups_answer_or_refuse_cleanly(surface: Surface, requests: list[pb.LookupRequest],
                                                   token: str | None, i: int) -> None:
    metadata = _metadata(token, [])
    answered = 0
    try:
        for request, response in zip(requests, surface.stub(i).StreamLookup(iter(requests), timeout=30,
                                                                            metadata=metadata), strict=False):
            _check_answer(request, response)
            answered += 1
        assert answered == len(requests)
        surface.ok()
    except grpc.RpcError as err:
        code = surface.refused(err)
        if _reader(metadata) is False:
            assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED), err.details()


@FUZZ
@given(method=st.sampled_from(["ListModels", "GetModel", "GetClusterInfo"]), model=models, token=tokens,
       extra=extra_metadata, i=st.integers(0, 3))
def test_metadata_calls_answer_or_refuse_cleanly(surface: Surface, method: str, model: str, token: str | None,
                                                 extra: list, i: int) -> None:
    metadata = _metadata(token, extra)
    stub = surface.stub(i)
    try:
        if method == "ListModels":
            names = {m.name for m in stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=metadata).models}
            reader = _reader(metadata)
            assert names == (reader if isinstance(reader, set) else set(DIMS))
        elif method == "GetModel":
            info = stub.GetModel(pb.GetModelRequest(model=model), timeout=30, metadata=metadata)
            assert info.name == model and {t.name: t.dim for t in info.tables} == DIMS[model]
        else:
            cluster = stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=30, metadata=metadata)
            assert cluster.shards >= 1 and cluster.partitions >= 1
    except grpc.RpcError as err:
        _expect_refused(surface, err, metadata, model if method == "GetModel" else None)
        return
    surface.ok()
    assert _reader(metadata) is not False


# ---- health and reflection -----------------------------------------------------------------------------------
services = st.one_of(st.sampled_from(["", "hps.v1.EmbeddingService", ACCEPTING_SERVICE, "demo", "nope"]), printable)


@FUZZ
@given(service=services, watch=st.booleans(), token=tokens, extra=extra_metadata, i=st.integers(0, 3))
def test_health_answers_anyone(surface: Surface, service: str, watch: bool, token: str | None, extra: list,
                               i: int) -> None:
    stub = health_pb2_grpc.HealthStub(surface.channels[i])
    metadata = _metadata(token, extra)
    request = health_pb2.HealthCheckRequest(service=service)
    try:
        if watch:
            stream = stub.Watch(request, timeout=30, metadata=metadata)
            status = next(stream).status
            stream.cancel()
        else:
            status = stub.Check(request, timeout=30, metadata=metadata).status
    except grpc.RpcError as err:
        assert surface.refused(err) == grpc.StatusCode.NOT_FOUND and not watch, err.details()
        return
    surface.ok()
    assert status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING,
                      health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)


symbols = st.one_of(st.sampled_from(["hps.v1.EmbeddingService", "hps.v1.LookupRequest", "grpc.health.v1.Health",
                                     "hps/v1/embedding.proto", ""]), printable)
reflection_requests = st.one_of(
    st.builds(reflection_pb2.ServerReflectionRequest, list_services=printable),
    st.builds(reflection_pb2.ServerReflectionRequest, file_by_filename=symbols),
    st.builds(reflection_pb2.ServerReflectionRequest, file_containing_symbol=symbols),
    st.builds(reflection_pb2.ServerReflectionRequest, all_extension_numbers_of_type=symbols),
    st.builds(reflection_pb2.ServerReflectionRequest, file_containing_extension=st.builds(
        reflection_pb2.ExtensionRequest, containing_type=symbols, extension_number=st.integers(-(2**31), 2**31 - 1))),
    st.builds(reflection_pb2.ServerReflectionRequest, host=printable))


@settings(FUZZ, max_examples=40 * EXAMPLES)
@given(requests=st.lists(reflection_requests, min_size=1, max_size=4), token=tokens, i=st.integers(0, 3))
def test_reflection_answers_anyone(surface: Surface, requests: list, token: str | None, i: int) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(surface.channels[i])
    try:
        responses = list(stub.ServerReflectionInfo(iter(requests), timeout=30, metadata=_metadata(token, [])))
    except grpc.RpcError as err:
        surface.refused(err, {grpc.StatusCode.RESOURCE_EXHAUSTED})  # the stream lane full: nothing else
        return
    surface.ok()
    assert len(responses) == len(requests)
    for response in responses:
        assert response.WhichOneof("message_response") is not None


# ---- bytes that are no message ---------------------------------------------------------------------------------
METHODS = {  # method: (request streams, response streams)
    "/hps.v1.EmbeddingService/Lookup": (False, False), "/hps.v1.EmbeddingService/StreamLookup": (True, True),
    "/hps.v1.EmbeddingService/ListModels": (False, False), "/hps.v1.EmbeddingService/GetModel": (False, False),
    "/hps.v1.EmbeddingService/GetClusterInfo": (False, False), "/grpc.health.v1.Health/Check": (False, False),
    "/grpc.health.v1.Health/Watch": (False, True),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": (True, True),
}


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), payload=st.binary(max_size=128), i=st.integers(0, 3))
def test_bytes_that_are_no_message_are_invalid_arguments(surface: Surface, method: str, payload: bytes,
                                                          i: int) -> None:
    channel, (request_streams, response_streams) = surface.channels[i], METHODS[method]
    metadata = (("authorization", f"Bearer {ALL}"),)
    try:
        if request_streams:
            list(channel.stream_stream(method)(iter([payload]), timeout=30, metadata=metadata))
        elif response_streams:
            stream = channel.unary_stream(method)(payload, timeout=30, metadata=metadata)
            next(stream)
            stream.cancel()
        else:
            channel.unary_unary(method)(payload, timeout=30, metadata=metadata)
    except grpc.RpcError as err:
        surface.refused(err)
        return
    surface.ok()  # the bytes happened to be a message the method answers


# ---- many idle calls at once ---------------------------------------------------------------------------------
class _Fed:
    """A streaming call fed from a queue (left idle after its first request), started on a channel of its own."""

    def __init__(self, stack: ExitStack, target: str, kind: str, token: str | None) -> None:
        channel = stack.enter_context(grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]))
        self._requests: queue.Queue = queue.Queue()
        metadata = _metadata(token, [])
        if kind == "lookup":
            first: Any = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=b"\0" * 8)])
            self.responses = pb_grpc.EmbeddingServiceStub(channel).StreamLookup(self._feed(), timeout=120,
                                                                                metadata=metadata)
        elif kind == "reflection":
            first = reflection_pb2.ServerReflectionRequest(list_services="")
            self.responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                self._feed(), timeout=120, metadata=metadata)
        else:
            first = None
            self.responses = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
        stack.callback(self.responses.cancel)
        stack.callback(self._requests.put, None)
        if first is not None:
            self._requests.put(first)

    def _feed(self) -> Iterator[Any]:
        while (request := self._requests.get()) is not None:
            yield request


@settings(FUZZ, max_examples=8 * EXAMPLES)
@given(calls=st.lists(st.tuples(st.sampled_from(["lookup", "reflection", "watch"]), tokens), min_size=4,
                      max_size=16))
def test_many_idle_calls_at_once_leave_lookups_served(surface: Surface, calls: list[tuple[str, str | None]]) -> None:
    """Idle streams of every kind opened at once, by readers and anonymous callers: each answered once or refused
    with a clear status (RESOURCE_EXHAUSTED past the lane's bounds), and unary Lookups answered meanwhile."""
    with ExitStack() as stack:
        opened = [_Fed(stack, surface.server.target, kind, token) for kind, token in calls]
        outcomes: list[str] = []

        def first_answer(fed: _Fed) -> None:
            try:
                next(fed.responses)
                outcomes.append("OK")
            except grpc.RpcError as err:
                outcomes.append(surface.refused(err).name)

        readers = [threading.Thread(target=first_answer, args=(fed,)) for fed in opened]
        for thread in readers:
            thread.start()
        for thread in readers:
            thread.join(30)
        assert len(outcomes) == len(calls)
        request = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=b"\1" + b"\0" * 7)])
        for i in range(8):
            started = time.monotonic()
            answer = surface.stub(i).Lookup(request, timeout=5, metadata=(("authorization", f"Bearer {ALL}"),))
            assert answer.tables[0].count == 1 and time.monotonic() - started < 3
    surface.check_workers()
