"""Open StreamLookup calls never take a thread a unary call needs (issue 29): they run on threads of their own, at
most ``server.max_streams`` per serving process; the stream past it gets RESOURCE_EXHAUSTED, and a stream that ends
frees its slot."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hps_client.attempts import PUSHBACK
from hps_service.client import build_request
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from hps_service.server.grpc_service import STREAM_LOOKUP
from hps_service.server.stream_lane import LanePool, on_pool
from tests.helpers import free_port
from tests.server.conftest import OpenStream, running, server_config, target

KEYS = np.arange(1, 9, dtype=np.int64)


def _open_streams(stack: ExitStack, srv: HPSServer, n: int) -> list[OpenStream]:
    """``n`` streams, each on a connection of its own (on a node, the kernel hands each to one worker), each
    answered once and then idle, waiting for its next request."""
    streams = []
    for _ in range(n):
        channel = stack.enter_context(grpc.insecure_channel(target(srv), options=[("grpc.use_local_subchannel_pool", 1)]))
        stream = OpenStream(pb_grpc.EmbeddingServiceStub(channel), timeout=60)
        stack.callback(stream._requests.put, None)
        started = time.monotonic()
        assert stream.ask(build_request("demo", {"item": KEYS})).tables[0].count == KEYS.size
        assert time.monotonic() - started < 5, "a stream waited for a thread"
        streams.append(stream)
    return streams


def _unary_latencies(srv: HPSServer, calls: int, timeout: float = 3.0) -> list[float]:
    """Seconds each of ``calls`` Lookups took, over a few connections of their own."""
    seconds = []
    with ExitStack() as stack:
        stubs = [pb_grpc.EmbeddingServiceStub(stack.enter_context(grpc.insecure_channel(
            target(srv), options=[("grpc.use_local_subchannel_pool", 1)]))) for _ in range(4)]
        for i in range(calls):
            started = time.perf_counter()
            assert stubs[i % 4].Lookup(build_request("demo", {"item": KEYS}), timeout=timeout).tables[0].count == 8
            seconds.append(time.perf_counter() - started)
    return seconds


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    """gRPC served by the owner itself, on one handler thread, at most 3 streams."""
    with running(server_config(tmp_path_factory.mktemp("single"), workers=0, grpc_workers=1, max_streams=3,
                                max_streams_per_caller=3)) as srv:
        yield srv


def test_idle_streams_leave_the_handler_threads_to_unary_calls(single: HPSServer) -> None:
    with ExitStack() as stack:
        _open_streams(stack, single, 3)
        seconds = _unary_latencies(single, 50)
    assert max(seconds) < 1.0, f"slowest unary call with 3 idle streams open: {max(seconds):.3f} s"


def test_idle_streams_on_a_node_leave_its_workers_to_unary_calls(tmp_path: Path) -> None:
    """Two workers with 2 handler threads each: 2x``workers`` idle streams used to take every thread (the issue's
    DEADLINE_EXCEEDED after 3 s)."""
    with running(server_config(tmp_path, workers=2, grpc_workers=2, max_streams=4,
                                 max_streams_per_caller=4)) as srv, ExitStack() as stack:
        _open_streams(stack, srv, 4)
        seconds = _unary_latencies(srv, 50)
    assert max(seconds) < 1.0, f"slowest unary call with 4 idle streams open: {max(seconds):.3f} s"


def test_the_stream_past_max_streams_is_refused_and_a_closed_one_frees_its_slot(single: HPSServer) -> None:
    refused_before = single.metrics.requests_served("StreamLookup", "RESOURCE_EXHAUSTED")
    with ExitStack() as stack:
        streams = _open_streams(stack, single, 3)
        with grpc.insecure_channel(target(single)) as channel:
            stub = pb_grpc.EmbeddingServiceStub(channel)
            refused = OpenStream(stub, timeout=10)
            stack.callback(refused._requests.put, None)
            with pytest.raises(grpc.RpcError) as err:
                refused.ask(build_request("demo", {"item": KEYS}))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "server.max_streams=3" in err.value.details(), err.value.details()
            assert (PUSHBACK, "-1") in tuple(err.value.trailing_metadata() or ())  # a limit: not to be retried
            assert single.metrics.requests_served("StreamLookup", "RESOURCE_EXHAUSTED") - refused_before == 1
            assert _unary_latencies(single, 5)  # the refusal took no unary thread for long

            streams[0].close()  # a stream that ends frees its slot ...
            _until_stream_opens(stub).close()
            streams[1].responses.cancel()  # ... and so does one its client cancels
            _until_stream_opens(stub).close()


def _until_stream_opens(stub: pb_grpc.EmbeddingServiceStub) -> OpenStream:
    """A new stream, once a slot is free (a stream's slot is given back as its handler returns, a moment after
    its client saw the end)."""
    deadline = time.monotonic() + 10
    while True:
        stream = OpenStream(stub, timeout=30)
        try:
            assert stream.ask(build_request("demo", {"item": KEYS})).tables[0].count == KEYS.size
            return stream
        except grpc.RpcError as err:
            stream._requests.put(None)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, err
            time.sleep(0.02)


class _Wrapping(grpc.ServerInterceptor):
    """Wraps every behavior in a function of its own, as OpenTelemetry's server interceptor does."""

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        inner = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(lambda it, ctx: inner(it, ctx))


def test_streams_stay_on_their_lane_under_interceptors() -> None:
    """gRPC runs a behavior with ``experimental_thread_pool`` on that pool; an interceptor's wrapper loses it,
    and LanePool, outermost, gives it back."""
    unary = futures.ThreadPoolExecutor(1, thread_name_prefix="unary")
    lane = futures.ThreadPoolExecutor(2, thread_name_prefix="lane")
    ran_on: list[str] = []

    def echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        ran_on.append(threading.current_thread().name)
        yield from requests

    service, method = STREAM_LOOKUP.rsplit("/", 1)
    handler = grpc.method_handlers_generic_handler(
        service[1:], {method: grpc.stream_stream_rpc_method_handler(on_pool(echo, lane))})
    for interceptors in ([], [_Wrapping()], [LanePool(lane), _Wrapping()]):
        server = grpc.server(unary, interceptors=interceptors)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        server.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert list(channel.stream_stream(STREAM_LOOKUP)(iter([b"a", b"b"]), timeout=10)) == [b"a", b"b"]
        server.stop(0).wait()
    assert [name.split("_")[0] for name in ran_on] == ["lane", "unary", "lane"]
