"""The client over two real replicas: health-aware balancing on the accepting service (a replica that stops accepting
leaves the rotation, update lag does not take one out), RESOURCE_EXHAUSTED of an overloaded replica retried on the
other (a request over a limit not retried), hedging past a stuck replica, errors with ``.code``/``.details``,
``metadata=`` and ``interceptors=``.

Replica A is a node (one worker process, 2 handler threads); replica B serves gRPC from its own process with one
handler thread, ``max_concurrent_requests: 2`` and ``max_streams: 1`` (gRPC's limit of calls in flight is their
sum), so a held lookup makes it slow, and three calls in flight make it refuse. Each holds rows of its own value
(1.0 on A, 2.0 on B), so every answer says which replica gave it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hps_client
from hps_client import (
    ACCEPTING_SERVICE,
    DeadlineExceededError,
    HPSClient,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from tests.server.conftest import AUTH, ITEM_DIM, HeldLookups, base_url, running, server_config, target

KEYS = np.arange(1, 9, dtype=np.int64)
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HPSServer, HPSServer]]:
    tmp = tmp_path_factory.mktemp("pair")
    with ExitStack() as stack:
        a = stack.enter_context(running(server_config(tmp / "a", workers=1, grpc_workers=2, max_batch_keys=64)))
        b = stack.enter_context(running(server_config(tmp / "b", workers=0, grpc_workers=1,
                                                      max_concurrent_requests=2, max_streams=1,
                                                      max_batch_keys=64)))
        for value, srv in ((1.0, a), (2.0, b)):
            with httpx.Client(base_url=base_url(srv)) as http:
                body = {"keys": KEYS.tolist(), "vectors": np.full((KEYS.size, ITEM_DIM), value).tolist()}
                assert http.put("/v1/models/demo/tables/item/embeddings", json=body, headers=AUTH).status_code == 200
        yield a, b


def _who(client: HPSClient, **kwargs: Any) -> str:
    """Which replica answered one lookup: "a" or "b"."""
    value = float(client.lookup("demo", "item", KEYS, **kwargs)[0, 0])
    return {1.0: "a", 2.0: "b"}[value]


def _connected(client: HPSClient) -> None:
    """Call until both replicas have answered (the channel is connected and healthy to both)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while seen != {"a", "b"}:
        assert time.monotonic() < deadline, f"only {seen} answered"
        seen.add(_who(client))


def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@contextmanager
def _busy(b: HPSServer, queued: int = 0) -> Iterator[None]:
    """B's one handler thread held by a lookup, and ``queued`` more calls waiting for it (an open stream would
    not do: it has a thread of its own)."""
    with HeldLookups(b) as held, grpc.insecure_channel(target(b)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        calls = [stub.Lookup.future(hps_client.build_request("demo", {"item": KEYS}), timeout=60)]
        held.wait_entered()
        calls += [stub.Lookup.future(hps_client.build_request("demo", {"item": KEYS}), timeout=60)
                  for _ in range(queued)]
        try:
            yield
        finally:
            held.release()
            for call in calls:
                call.exception()


def _accepting(srv: HPSServer) -> int:
    with grpc.insecure_channel(target(srv)) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=ACCEPTING_SERVICE), timeout=10).status


def test_a_replica_that_stops_accepting_leaves_the_rotation_and_update_lag_does_not(pair: tuple[HPSServer,
                                                                                              HPSServer]) -> None:
    a, b = pair
    with HPSClient([target(a), target(b)], timeout=10) as client:
        _connected(client)
        b.gate.begin_draining()  # a lame duck: it would still answer, but says it does not accept calls
        try:
            b.update_health()
            assert _accepting(b) != SERVING
            streak: list[str] = []

            def left() -> bool:  # within one health update (the Watch stream brings it): four in a row from A
                streak.append(_who(client))
                return streak[-4:] == ["a"] * 4

            _until(left, 2.0, f"B stayed in the rotation: {streak[-20:]}")
            assert {_who(client) for _ in range(40)} == {"a"}
        finally:
            b.gate.draining = False
            b.update_health()
        # Both lag behind the update log (a broker outage): not ready for probes, still in the clients' rotation.
        for srv in pair:
            srv.readiness.append(lambda: "update consumer is 120 s behind")
        try:
            for srv in pair:
                srv.update_health()
                assert srv.not_ready() and _accepting(srv) == SERVING
            seen: set[str] = set()
            _until(lambda: seen.add(_who(client)) or seen == {"a", "b"}, 5.0, f"only {seen} answered while lagging")
        finally:
            for srv in pair:
                srv.readiness.clear()
                srv.update_health()


def test_health_watches_do_not_hold_the_handler_threads(pair: tuple[HPSServer, HPSServer]) -> None:
    """Each client connection keeps one health Watch open; a worker's 2 handler threads still answer lookups with
    eight of them open (the Watch handler returns at once and answers from callbacks)."""
    a, _ = pair
    with ExitStack() as stack:
        watches = []
        for _ in range(8):
            channel = stack.enter_context(grpc.insecure_channel(target(a)))
            stream = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=ACCEPTING_SERVICE), timeout=60)
            watches.append(stream)
            assert next(stream).status == SERVING
        with HPSClient(target(a), timeout=5) as client:
            for _ in range(10):
                assert client.lookup("demo", "item", KEYS).shape == (KEYS.size, ITEM_DIM)
        for stream in watches:
            stream.cancel()


def test_overloaded_replica_is_retried_elsewhere_and_a_limit_is_not(pair: tuple[HPSServer, HPSServer]) -> None:
    a, b = pair
    with HPSClient([target(a), target(b)], timeout=10) as client:
        _connected(client)
        with _busy(b, queued=2):  # B's one handler thread is held, two more calls wait: it refuses more
            _until(lambda: _refused(b), 10.0, "B never refused a call")
            assert {_who(client) for _ in range(20)} == {"a"}  # every call B refused went on to A
            refusals = sum(s.metrics.requests_served("Lookup", "RESOURCE_EXHAUSTED") for s in pair)
            with pytest.raises(ResourceExhaustedError, match="max_batch_keys") as raised:
                client.lookup("demo", "item", np.arange(100))
            assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            # the server's pushback stopped the retry policy: one attempt refused by a server, not four
            assert sum(s.metrics.requests_served("Lookup", "RESOURCE_EXHAUSTED") for s in pair) - refusals == 1


def _refused(srv: HPSServer) -> bool:
    with grpc.insecure_channel(target(srv)) as channel:
        try:
            pb_grpc.EmbeddingServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=5)
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False


def test_hedging_answers_past_a_stuck_replica(pair: tuple[HPSServer, HPSServer]) -> None:
    """B's one handler thread is held by a lookup, so a call that lands on B waits there. Without hedging such a
    call runs into its deadline; with ``hedging=`` (gRPC's hedgingPolicy) a second copy goes to A after 50 ms (and
    one at once when B refuses, RESOURCE_EXHAUSTED being non-fatal here)."""
    a, b = pair
    policy = {"maxAttempts": 2, "hedgingDelay": "0.05s", "nonFatalStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]}
    _until(lambda: not _refused(b), 30.0, "B is still busy with an earlier test's calls")
    with HPSClient([target(a), target(b)], timeout=10, hedging=policy) as hedged, \
            HPSClient([target(a), target(b)], timeout=0.5, retries=0) as plain:
        _connected(hedged)
        _connected(plain)
        with _busy(b):  # B's only thread is now held
            with pytest.raises(DeadlineExceededError) as raised:
                for _ in range(4):
                    _who(plain)
            assert isinstance(raised.value, TimeoutError) and raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            started = time.monotonic()
            assert {_who(hedged) for _ in range(6)} == {"a"}
            assert time.monotonic() - started < 5.0
    with pytest.raises(InvalidArgumentError, match="maxAttempts"):
        HPSClient(target(a), hedging={"maxAttempts": 9})


class _Recorder(grpc.UnaryUnaryClientInterceptor):
    """Records the metadata of each unary call it sees."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.seen.append(tuple(details.metadata or ()))
        return continuation(details, request)


def _late_lookup(b: HPSServer) -> DeadlineExceededError:
    """The error of a lookup that cannot be answered within its deadline: B's one handler thread is held by a
    lookup, so the call waits for it (a deadline of microseconds is no test: gRPC rounds it up to a millisecond, and
    a loopback answer can beat that)."""
    _until(lambda: not _refused(b), 30.0, "B is still busy with an earlier test's calls")
    with HPSClient(target(b), timeout=10, retries=0) as client:
        assert _who(client) == "b"  # connected
        with _busy(b), pytest.raises(DeadlineExceededError) as late:  # B's only thread is now held
            client.lookup("demo", "item", KEYS, timeout=0.3)
    return late.value


def test_errors_metadata_and_interceptors(pair: tuple[HPSServer, HPSServer]) -> None:
    a, b = pair
    recorder = _Recorder()
    with HPSClient(target(a), timeout=10, metadata=[("x-team", "ranking")], interceptors=[recorder]) as client:
        client.lookup("demo", "item", KEYS, metadata=[("x-request-id", "r-1")])
        assert recorder.seen[-1] == (("x-team", "ranking"), ("x-request-id", "r-1"))
        with pytest.raises(NotFoundError) as raised:
            client.lookup("demo", "nope", KEYS)
        assert raised.value.code == grpc.StatusCode.NOT_FOUND and "no table 'nope'" in raised.value.details
        assert str(raised.value).startswith("NOT_FOUND: ")
        late = _late_lookup(b)
        assert isinstance(late, TimeoutError) and late.code == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.warns(DeprecationWarning, match="LookupError_"):
            old_catch_all = hps_client.LookupError_
        assert isinstance(late, old_catch_all)
        with pytest.raises(InvalidArgumentError, match="lower-case"):
            client.lookup("demo", "item", KEYS, metadata=[("X-Upper", "1")])
