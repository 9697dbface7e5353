"""Tracing (``server.tracing``) of a real ``hps serve`` with two gRPC worker processes and a Redis Cluster L2.

The server exports its spans with OpenTelemetry's own OTLP/gRPC exporter to a collector this test runs (the OTLP
TraceService, from the ``opentelemetry-proto`` stubs): the spans are made in the worker processes, so an in-memory
exporter in this process could not see them, and this is the path a deployment takes (to an OpenTelemetry
Collector). The clients are instrumented as an inference service would instrument them, with an in-memory exporter
(the async client with OpenTelemetry's grpc.aio interceptors in this process; the sync client with its
GrpcInstrumentorClient, which needs the global tracer provider, in a process of its own), so each server span can be
matched to the client span that called it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk")

from grpc_health.v1 import health  # noqa: E402
from opentelemetry import propagate, trace  # noqa: E402
from opentelemetry.instrumentation.grpc import aio_client_interceptors  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from hps_client import AsyncHPSClient, HPSClient, InvalidArgumentError  # noqa: E402
from hps_service.admin.jobs import JobRunner  # noqa: E402
from hps_service.config import ConfigError, load_config  # noqa: E402
from hps_service.engine import LookupEngine  # noqa: E402
from hps_service.fleet.registry_log import ModelRegistrations
from hps_service.proto.hps.v1 import embedding_pb2 as pb  # noqa: E402
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc  # noqa: E402
from hps_service.runtime.gate import ServingGate
from hps_service.server.call_tracing import admin_app, grpc_tracing  # noqa: E402
from hps_service.server.grpc_server import build_grpc_server  # noqa: E402
from hps_service.server.grpc_service import EmbeddingServicer  # noqa: E402
from hps_service.server.metrics import ServerMetrics  # noqa: E402
from hps_service.server.rest import AdminContext  # noqa: E402
from tests.fixtures.otlp_collector import Collector, OtlpCollector, Span  # noqa: E402
from tests.fixtures.redis_cluster import RedisClusterProcess  # noqa: E402
from tests.helpers import ServerProcess, free_port, write_config  # noqa: E402

TOKEN = "trace-token"
DIM, ROWS = 8, 1024
LOOKUP = "/hps.v1.EmbeddingService/Lookup"
HITS = ("hps.hits.cache", "hps.hits.volatile", "hps.hits.persistent", "hps.misses")  # sources 1, 2, 3, 4


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    with OtlpCollector() as running:
        yield running.spans, running.port


@dataclass
class Node:
    srv: ServerProcess
    http: httpx.Client
    worker_pids: set[int]


@pytest.fixture(scope="module")
def node(tmp_path_factory, collector, redis_cluster: RedisClusterProcess) -> Iterator[Node]:
    redis_cluster.restart_all()
    root = tmp_path_factory.mktemp("tracing")
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(root / "hps.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "workers": 2, "admin_token": TOKEN,
                   "log_format": "json", "max_connection_age_s": 0, "grace_period_s": 2,
                   "tracing": {"enabled": True, "endpoint": f"http://127.0.0.1:{collector[1]}",
                               "export_interval_s": 0.1, "service_name": "hps-under-test"}},
        "cache": {"capacity": 4096, "warm_start": False},
        "volatile": {"type": "redis_cluster", "nodes": redis_cluster.nodes, "node_retry_after_s": 0.2},
        "persistent": {"path": str(root / "rocksdb")},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": DIM}]}],
    })
    with ServerProcess(cfg, grpc_port) as srv:
        http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30,
                            headers={"Authorization": f"Bearer {TOKEN}"})
        rows = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
        put = http.put("/v1/models/demo/tables/item/embeddings",
                       json={"keys": list(range(ROWS)), "vectors": rows.tolist(), "version": 1})
        assert put.status_code == 200, put.text
        pids = {w["pid"] for w in http.get("/v1/stats").json()["node"]["workers"]}
        yield Node(srv, http, pids)
        http.close()


@pytest.fixture(scope="module")
def client_tracing() -> tuple[trace.Tracer, InMemorySpanExporter, list]:
    """An inference service's tracer and OpenTelemetry's grpc.aio client interceptors (W3C traceparent sent)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("inference"), exporter, aio_client_interceptors(tracer_provider=provider)


def _own_client(target: str, interceptors: list) -> AsyncHPSClient:
    """A client with a connection of its own: the kernel hands each connection to one worker (SO_REUSEPORT)."""
    return AsyncHPSClient(target, interceptors=interceptors, options=[("grpc.use_local_subchannel_pool", 1)])


def _children(spans: list[Span], parent: Span, name: str) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id and s.name == name]


def test_lookup_spans_follow_the_caller_from_whichever_worker_answered(node, collector, client_tracing) -> None:
    tracer, client_spans, interceptors = client_tracing
    received, _ = collector
    unsampled = trace.NonRecordingSpan(trace.SpanContext(int("ab" * 16, 16), int("cd" * 8, 16), is_remote=False,
                                                         trace_flags=trace.TraceFlags(0)))

    async def infer() -> list[tuple[str, str, int, np.ndarray]]:
        with trace.use_span(unsampled):
            async with _own_client(node.srv.target, interceptors) as c:
                await c.lookup("demo", "item", [1, 2], metadata=[("x-request-id", "req-unsampled")])
        calls = []
        for i in range(16):
            keys = np.arange(i * 16, i * 16 + 24, dtype=np.int64)  # overlapping: cache, volatile and stored hits
            rid = f"req-{i}".ljust(128, "x") if i == 0 else f"req-{i}"  # the longest request id taken
            with tracer.start_as_current_span(f"infer-{i}") as root:
                async with _own_client(node.srv.target, interceptors) as c:
                    answer = await c.lookup_with_sources("demo", "item", keys, metadata=[("x-request-id", rid)])
            np.testing.assert_array_equal(answer.vectors[:, 0], keys * DIM)
            counts = np.bincount(answer.sources, minlength=5)[1:]
            calls.append((trace.format_trace_id(root.get_span_context().trace_id), rid, keys.size, counts))
        return calls

    calls = asyncio.run(infer())
    pids = set()
    for trace_id, rid, n, counts in calls:
        client = [s for s in client_spans.get_finished_spans() if s.name == LOOKUP
                  and trace.format_trace_id(s.context.trace_id) == trace_id]
        assert len(client) == 1 and client[0].kind == trace.SpanKind.CLIENT
        (server,) = received.wait(lambda spans, t=trace_id: [s for s in spans if s.trace_id == t and s.name == LOOKUP],
                                  f"{LOOKUP} in trace {trace_id}")
        assert server.parent_id == format(client[0].context.span_id, "016x")  # W3C traceparent from the client
        assert server.kind == 2  # SERVER
        assert server.attributes["rpc.system"] == "grpc" and server.attributes["hps.request_id"] == rid
        assert server.resource["service.name"] == "hps-under-test"
        assert server.resource["process.pid"] in node.worker_pids
        assert server.resource["hps.process"].startswith("worker-")
        pids.add(server.resource["process.pid"])
        (lookup,) = received.wait(lambda spans, p=server: _children(spans, p, "hps.lookup"), "hps.lookup")
        assert (lookup.attributes["hps.model"], lookup.attributes["hps.table"], lookup.attributes["hps.keys"]) == \
            ("demo", "item", n)
        assert [lookup.attributes[h] for h in HITS] == counts.tolist()  # what the client was told, per tier
        assert lookup.resource["process.pid"] == server.resource["process.pid"]
    assert pids == node.worker_pids  # 16 connections: both workers answered (2 in 65,536 runs would fail)
    assert sum(c[3][0] for c in calls) > 0 and sum(c[3][1] + c[3][2] for c in calls) > 0  # cache and tier hits
    # both workers exported everything served after the unsampled call: it would be there had it been traced
    assert not [s for s in received.spans if s.attributes.get("hps.request_id") == "req-unsampled"]
    assert not [s for s in received.spans if s.name.startswith("/grpc.health")]


def test_a_request_id_is_made_when_none_is_sent_and_a_bad_one_is_refused(node, collector) -> None:
    received, _ = collector
    request = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=np.arange(3, dtype="<i8").tobytes())])
    with grpc.insecure_channel(node.srv.target) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        stub.Lookup(request, timeout=10, metadata=[("traceparent", f"00-{'e1' * 16}-{'f2' * 8}-01")])  # no request id
        for bad in ("r" * 129, "has space"):
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(request, timeout=10, metadata=[("x-request-id", bad)])
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-request-id" in err.value.details()
    (made,) = received.wait(lambda spans: [s for s in spans if s.trace_id == "e1" * 16 and s.name == LOOKUP],
                            "of the call without an id")
    assert made.parent_id == "f2" * 8 and re.fullmatch("[0-9a-f]{16}", made.attributes["hps.request_id"])
    with HPSClient(node.srv.target) as c, pytest.raises(InvalidArgumentError, match="x-request-id"):
        c.lookup("demo", "item", [1], metadata=[("x-request-id", "r" * 129)])
    bad = node.http.get("/v1/models/demo/tables/item/embeddings", params={"keys": "1"},
                        headers={"x-request-id": "r" * 129})
    assert bad.status_code == 400 and "x-request-id" in bad.json()["detail"]


def test_rest_lookups_are_traced_in_the_owner(node, collector, client_tracing) -> None:
    tracer, _, _ = client_tracing
    received, _ = collector
    with tracer.start_as_current_span("admin") as root:
        headers: dict[str, str] = {}
        propagate.inject(headers)  # what an instrumented HTTP client sends
        r = node.http.get("/v1/models/demo/tables/item/embeddings", params={"keys": "1,2,3"},
                          headers={**headers, "X-Request-ID": "rest-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rest-1"
    trace_id = trace.format_trace_id(root.get_span_context().trace_id)
    (server,) = received.wait(lambda spans: [s for s in spans if s.trace_id == trace_id and s.kind == 2], "REST")
    assert server.parent_id == format(root.get_span_context().span_id, "016x")
    assert server.attributes["hps.request_id"] == "rest-1"
    assert server.attributes["http.route"] == "/v1/models/{model}/tables/{table}/embeddings"
    assert server.resource["hps.process"] == "owner" and server.resource["process.pid"] == node.srv.proc.pid
    (lookup,) = received.wait(lambda spans: _children(spans, server, "hps.lookup"), "hps.lookup under REST")
    assert lookup.attributes["hps.keys"] == 3 and sum(lookup.attributes[h] for h in HITS) == 3
    assert len([s for s in received.spans if s.trace_id == trace_id]) == 2  # no receive/send spans, no FastAPI ones


#: An inference service with the sync client: the global tracer provider (OpenTelemetry's GrpcInstrumentorClient
#: reads only that one) and the instrumentor, which instruments every channel the client opens. It prints the trace
#: and span ids of its call.
INFERENCE = """
import json, sys
import numpy as np
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import GrpcInstrumentorClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from hps_client import HPSClient

exporter = InMemorySpanExporter()
trace.set_tracer_provider(TracerProvider())
trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
GrpcInstrumentorClient().instrument()
keys = np.arange(600, 900, dtype=np.int64)
with HPSClient(sys.argv[1]) as c, trace.get_tracer("inference").start_as_current_span("infer"):
    answer = c.lookup_with_sources("demo", "item", keys, metadata=[("x-request-id", "req-redis-down")])
assert (answer.vectors[:, 0] == keys * 8).all()
(span,) = [s for s in exporter.get_finished_spans() if s.name.endswith("/Lookup")]
print(json.dumps({"trace_id": trace.format_trace_id(span.context.trace_id), "span_id": format(span.context.span_id, "016x"),
                  "kind": span.kind.name}))
"""


def test_log_lines_of_a_call_carry_its_request_and_trace_ids(node, collector, redis_cluster) -> None:
    """A Redis master dies: the worker serving the next lookup (of keys never looked up, so not in L1) logs the
    failed node in that call and answers from RocksDB; the line names the call's request id and trace id."""
    received, _ = collector
    redis_cluster.kill(0)
    try:
        done = subprocess.run([sys.executable, "-c", INFERENCE, node.srv.target], capture_output=True, text=True,
                              timeout=60, cwd=Path(__file__).resolve().parents[2])
    finally:
        redis_cluster.restart(0)
    assert done.returncode == 0, done.stderr[-3000:]
    client = json.loads(done.stdout)
    assert client["kind"] == "CLIENT"
    (server,) = received.wait(lambda spans: [s for s in spans if s.trace_id == client["trace_id"] and s.name == LOOKUP],
                              "of the sync client's call")
    assert server.parent_id == client["span_id"] and server.attributes["hps.request_id"] == "req-redis-down"
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in node.srv.log().splitlines() if line.startswith("{")]
        mine = [e for e in lines if e.get("request_id") == "req-redis-down"]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert any("redis_cluster: node" in e["message"] and "failed" in e["message"] for e in mine), mine or lines[-5:]
    assert all(e["trace_id"] == client["trace_id"] for e in mine)
    # none leaks into other lines (the audit lines of the fixture's REST writes carry their own calls' ids)
    assert not [e for e in lines if "request_id" in e and e["request_id"] != "req-redis-down"
                and e.get("logger") != "hps.audit"]


def test_tracing_off_builds_nothing_of_it(monkeypatch) -> None:
    """With tracing off (the default) the gRPC server gets no interceptor, the servicer keeps its engine and the REST
    app is the plain one; none of it imports the tracing package (made unimportable here)."""
    monkeypatch.setitem(sys.modules, "hps_service.server.tracing", None)
    cfg = load_config(persistent={"type": "disabled"}, volatile={"type": "disabled"})
    engine = LookupEngine(None, None)
    servicer = EmbeddingServicer(engine, cfg.server, ServingGate())
    assert grpc_tracing(servicer, "owner") == [] and servicer.engine is engine
    build_grpc_server(cfg, servicer, health.HealthServicer()).server.stop(0)
    registrations = ModelRegistrations(engine, (), lambda: None)
    app = admin_app(AdminContext(engine, cfg, ServerMetrics(engine), ServingGate(), JobRunner(), None,
                                 lambda: ([], {}), registrations))
    assert not getattr(app, "_is_instrumented_by_opentelemetry", False)


def test_tracing_without_the_otel_extra_names_it(monkeypatch) -> None:
    for name in [m for m in sys.modules if m.startswith("hps_service.server.tracing")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if the SDK were not installed
    with pytest.raises(ConfigError, match=r"server.tracing.enabled needs the otel extra \(pip install 'hps-service\[otel\]'\)"):
        importlib.import_module("hps_service.server.tracing")


def test_text_log_lines_name_the_call() -> None:
    """Text lines get the ids as a suffix while a call is served, and nothing outside one."""
    from hps_service.runtime.call_context import CallInfo, serving
    from hps_service.runtime.logs import CallFilter, TextFormatter

    formatter, only = TextFormatter("%(levelname)s %(message)s"), CallFilter()

    def line() -> str:
        record = logging.LogRecord("hps", logging.WARNING, __file__, 1, "node failed", None, None)
        only.filter(record)
        return formatter.format(record)

    with serving(CallInfo("req-7", "ab" * 16)):
        assert line() == f"WARNING node failed [request_id=req-7 trace_id={'ab' * 16}]"
    with serving(CallInfo("req-8")):
        assert line() == "WARNING node failed [request_id=req-8]"
    assert line() == "WARNING node failed"


def test_the_traced_engines_spell_out_every_method_of_the_engine_protocols() -> None:
    """A method added to ``Engine`` or ``ReadEngine`` must be traced or passed through by name in the wrappers (mypy
    refuses to build one that lacks it); none reaches the engine through a catch-all."""
    from hps_service.engine.api import Engine, ReadEngine
    from hps_service.server.tracing.lookups import TracedEngine, TracedReadEngine

    for protocol, wrapper in ((ReadEngine, TracedReadEngine), (Engine, TracedEngine)):
        methods = {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or
                                                                                     isinstance(v, property))}
        own = {n for cls in wrapper.__mro__ if cls.__module__ == wrapper.__module__ for n in vars(cls)}
        assert methods and methods <= own, sorted(methods - own)
    assert not hasattr(TracedEngine, "__getattr__")
