"""Every streaming method is on the stream lane (issue 57): idle reflection streams and health watches never take
the handler threads unary Lookups need (two used to stop every Lookup of a worker, read auth on or not), one caller
cannot hold every stream slot, and a stream idle for ``server.stream_idle_timeout_s`` is closed with a status that
names the key, its slot given back. Health watches (hps-client keeps one per connection) are bounded apart, by
``server.max_watches``, and never closed for idling."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hps_service.client import build_request
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from tests.helpers import ServerProcess, free_port, write_config
from tests.server.conftest import running, server_config, target

TOKENS = {"a": "reader-a-token-0123456789", "b": "reader-b-token-0123456789"}
READERS = [{"name": name, "token": token, "models": ["*"]} for name, token in TOKENS.items()]
LIST_SERVICES = reflection_pb2.ServerReflectionRequest(list_services="")


def _bearer(reader: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[reader]}"),)


class Fed:
    """A streaming call of any method, fed from a queue: ``ask`` sends one request and reads one answer."""

    def __init__(self, method: Any, metadata: tuple[tuple[str, str], ...] | None = None, timeout: float = 300) -> None:
        self._requests: queue.Queue = queue.Queue()
        self.responses = method(self._feed(), timeout=timeout, metadata=metadata)

    def _feed(self) -> Iterator[Any]:
        while (request := self._requests.get()) is not None:
            yield request

    def ask(self, request: Any) -> Any:
        self._requests.put(request)
        return next(self.responses)

    def end(self) -> None:
        self._requests.put(None)


def _channel(stack: ExitStack, where: str) -> grpc.Channel:
    """A connection of its own to ``where``."""
    return stack.enter_context(grpc.insecure_channel(where, options=[("grpc.use_local_subchannel_pool", 1)]))


def _reflection(stack: ExitStack, where: str, metadata: tuple[tuple[str, str], ...] | None = None) -> Fed:
    """An open reflection stream, answered once, now idle."""
    stream = Fed(reflection_pb2_grpc.ServerReflectionStub(_channel(stack, where)).ServerReflectionInfo, metadata)
    stack.callback(stream.end)
    assert stream.ask(LIST_SERVICES).list_services_response.service
    return stream


def _watch(stack: ExitStack, where: str) -> Iterator[health_pb2.HealthCheckResponse]:
    """An open health Watch, answered once (SERVING), now waiting for a change."""
    watch = health_pb2_grpc.HealthStub(_channel(stack, where)).Watch(health_pb2.HealthCheckRequest(service=""),
                                                                      timeout=300)
    stack.callback(watch.cancel)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    return watch


def test_idle_reflection_streams_and_watches_leave_a_worker_its_lookups(tmp_path: Path) -> None:
    """The issue's reproduction: one worker with two handler threads, read auth on; an anonymous client holds two
    reflection streams open (each answered within a second) and authenticated Lookups are still answered at once;
    a health Watch opened then does not wait for a thread either."""
    grpc_port = free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": free_port(), "workers": 1, "grpc_workers": 2,
                   "auth": "token", "readers": READERS},
        "cache": {"backend": "numpy", "capacity": 1024},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 4}]}],
    })
    with ServerProcess(cfg, grpc_port) as srv, ExitStack() as stack:
        for _ in range(2):
            started = time.monotonic()
            _reflection(stack, srv.target)
            assert time.monotonic() - started < 1
        stub = pb_grpc.EmbeddingServiceStub(_channel(stack, srv.target))
        for _ in range(20):
            started = time.monotonic()
            answer = stub.Lookup(build_request("demo", {"item": [1, 2]}), timeout=3, metadata=_bearer("a"))
            assert answer.tables[0].count == 2
            assert time.monotonic() - started < 2
        started = time.monotonic()
        _watch(stack, srv.target)
        assert time.monotonic() - started < 1
        assert srv.proc is not None and srv.proc.poll() is None


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    """Read auth on, 4 stream slots (so one caller may hold 1 by default), one unary handler thread."""
    cfg = server_config(tmp_path_factory.mktemp("capped"), workers=0, grpc_workers=1, max_streams=4, auth="token",
                        readers=READERS)
    with running(cfg) as srv:
        yield srv


def _refused(open_stream: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        open_stream()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    return err.value


def test_one_caller_cannot_hold_every_stream_slot(capped: HPSServer) -> None:
    """Readers are told apart by their credential, anonymous callers by their address: each holds at most
    max_streams // 4 (here 1) of the slots, and the others still open theirs."""
    request = build_request("demo", {"item": [1]})
    with ExitStack() as stack:
        first = Fed(pb_grpc.EmbeddingServiceStub(_channel(stack, target(capped))).StreamLookup, _bearer("a"))
        stack.callback(first.end)
        assert first.ask(request).tables[0].count == 1
        refused = _refused(lambda: Fed(pb_grpc.EmbeddingServiceStub(_channel(stack, target(capped))).StreamLookup,
                                       _bearer("a")).ask(request))
        assert "reader a" in refused.details() and "server.max_streams_per_caller=1" in refused.details()
        other = Fed(pb_grpc.EmbeddingServiceStub(_channel(stack, target(capped))).StreamLookup, _bearer("b"))
        stack.callback(other.end)
        assert other.ask(request).tables[0].count == 1
        _reflection(stack, target(capped))  # anonymous, from this address: its one slot
        refused = _refused(lambda: _reflection(stack, target(capped)))
        assert "ipv4:127.0.0.1" in refused.details(), refused.details()
        for _ in range(8):  # watches are counted apart (hps-client keeps one per connection)
            _watch(stack, target(capped))
        first.end()  # a slot given back is a caller's to take again
        assert list(first.responses) == []
        again = Fed(pb_grpc.EmbeddingServiceStub(_channel(stack, target(capped))).StreamLookup, _bearer("a"))
        stack.callback(again.end)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert again.ask(request).tables[0].count == 1
                break
            except grpc.RpcError as err:  # its slot is given back as the handler returns, a moment after the end
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, err
                again = Fed(pb_grpc.EmbeddingServiceStub(_channel(stack, target(capped))).StreamLookup, _bearer("a"))
                stack.callback(again.end)
                time.sleep(0.05)


def test_a_stream_idle_past_its_timeout_is_closed_and_its_slot_given_back(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, workers=0, grpc_workers=1, max_streams=3, max_streams_per_caller=3,
                        stream_idle_timeout_s=2.0)
    request = build_request("demo", {"item": [1]})
    with running(cfg) as srv, ExitStack() as stack:
        lookups = Fed(pb_grpc.EmbeddingServiceStub(_channel(stack, target(srv))).StreamLookup)
        stack.callback(lookups.end)
        lookups.ask(request)
        busy = Fed(pb_grpc.EmbeddingServiceStub(_channel(stack, target(srv))).StreamLookup)
        stack.callback(busy.end)
        reflection = _reflection(stack, target(srv))
        watch = _watch(stack, target(srv))
        started = time.monotonic()
        while time.monotonic() - started < 4.5:  # a stream that keeps asking is never idle
            assert busy.ask(request).tables[0].count == 1
            time.sleep(0.2)
        for stream in (lookups, reflection):
            with pytest.raises(grpc.RpcError) as err:
                stream.ask(request if stream is lookups else LIST_SERVICES)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
            assert "server.stream_idle_timeout_s" in err.value.details()
        assert watch.is_active()  # a watch answers changes: idle by design, never closed for it
        busy.end()
        with ExitStack() as fresh:  # the three slots are free again (max_streams=3)
            for _ in range(3):
                _reflection(fresh, target(srv))


def test_watches_are_bounded_apart(tmp_path: Path) -> None:
    """server.max_watches bounds the open health watches, a quarter of them per caller; a cancelled one gives its
    slot back."""
    with running(server_config(tmp_path, workers=0, max_watches=8)) as srv, ExitStack() as stack:
        watches = [_watch(stack, target(srv)) for _ in range(2)]
        refused = _refused(lambda: _watch(stack, target(srv)))
        assert "a quarter of server.max_watches (2)" in refused.details(), refused.details()
        watches[0].cancel()
        deadline = time.monotonic() + 10
        while True:
            try:
                _watch(stack, target(srv))
                break
            except (grpc.RpcError, AssertionError):
                assert time.monotonic() < deadline, "a cancelled watch never gave its slot back"
                time.sleep(0.05)
