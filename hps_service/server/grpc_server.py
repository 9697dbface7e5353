"""The gRPC server of a serving process (the owner, or each of a node's workers): the EmbeddingService, health
checking and reflection, with the message limits and connection options of ``server``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hps_service.config import HPSConfig, ServerConfig
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.runtime.gate import DRAINING, ServingGate
from hps_service.server.call_tracing import grpc_tracing
from hps_service.server.grpc_service import EmbeddingServicer, add_embedding_service
from hps_service.server.registration import Registrar
from hps_service.server.stream_lane import REFUSAL_THREADS, LanePool, StreamLane

_MiB = 1 << 20
_P = ParamSpec("_P")
_T = TypeVar("_T")
#: How long a draining server waits after its last call answered before it stops (see :meth:`HandlerPool.wait_idle`).
DRAIN_SETTLE_S = 0.5


class HandlerPool(futures.ThreadPoolExecutor):
    """The gRPC server's handler pool. It records, per call, how long the call waited for a thread (the server
    submits a call the moment it arrives), and it counts the calls not yet answered, so a draining server knows when
    its last answer went out."""

    def __init__(self, observe_queue_wait: Callable[[float], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._observe = observe_queue_wait
        self._calls_lock = threading.Lock()
        self._unanswered = 0
        self._last_answer = 0.0

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> futures.Future[_T]:
        queued = time.perf_counter()

        def timed() -> _T:
            try:
                self._observe(time.perf_counter() - queued)
                return fn(*args, **kwargs)
            finally:
                with self._calls_lock:
                    self._unanswered -= 1
                    self._last_answer = time.monotonic()

        with self._calls_lock:
            self._unanswered += 1
        try:
            return super().submit(timed)
        except BaseException:
            with self._calls_lock:
                self._unanswered -= 1
            raise

    def is_idle(self, settle_s: float) -> bool:
        """No call is unanswered, and the last answer went out ``settle_s`` ago."""
        with self._calls_lock:
            return self._unanswered == 0 and time.monotonic() - self._last_answer >= settle_s

    def wait_idle(self, settle_s: float, timeout_s: float) -> bool:
        """Block until :meth:`is_idle` (or ``timeout_s`` passed; False then). gRPC closes a connection the moment
        its last call ends after the server's GOAWAY, and a client still reading a large answer then gets a TCP reset
        in place of the answer's tail; a server that waits here before it stops lets its clients read what it
        answered."""
        return wait_all_idle((self,), settle_s, timeout_s)


class Idle(Protocol):
    """What a drain waits on: a pool of handler threads, or a native front (``server.front: native``)."""

    def is_idle(self, settle_s: float) -> bool: ...


class Front(Idle, Protocol):
    """A front that serves the port in place of the grpcio server, which then listens behind it."""

    def start(self) -> None: ...

    def close(self) -> None: ...


def wait_all_idle(pools: tuple[Idle, ...], settle_s: float, timeout_s: float) -> bool:
    """Block until every pool :meth:`~HandlerPool.is_idle` at once (or ``timeout_s`` passed; False then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(pool.is_idle(settle_s) for pool in pools):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def message_limits(config: HPSConfig) -> tuple[int, int]:
    """Max receive and send message sizes: server.max_message_bytes, else what fits the configured batch limit
    (plus protobuf overhead)."""
    max_dim = max((t.dim for m in config.models for t in m.tables), default=1024)
    n = config.server.max_batch_keys
    receive = config.server.max_message_bytes or n * 8 + config.server.max_tables_per_request * 1024 + _MiB
    send = n * (4 * max(max_dim, 1024) + 1) + config.server.max_tables_per_request * 1024 + _MiB
    return receive, send


def grpc_connection_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """Keepalive and connection age of the gRPC server: idle connections are pinged, clients may ping every
    ``min_client_ping_interval_s``, and a connection older than ``max_connection_age_s`` is closed with GOAWAY (its
    calls get ``max_connection_age_grace_s``), so clients reconnect and re-balance over the replicas there are now."""
    options = [
        ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(cfg.min_client_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
        # what a connection's peer can make the server hold: its calls in flight, each answer at most
        # grpc.max_send_message_length; a further call waits in the client until one ends
        ("grpc.max_concurrent_streams", cfg.max_calls_per_connection),
    ]
    if cfg.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", int(cfg.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(cfg.max_connection_age_grace_s * 1000)),
        ]
    return options


@dataclass
class ServingGrpc:
    """A serving process's gRPC server, the handler pool its unary calls run on and the one of its streams."""

    server: grpc.Server
    pool: HandlerPool
    streams: HandlerPool | None = None
    #: ``server.front: native``: what serves the port; the grpcio server is behind it (stopped after it).
    front: Front | None = None

    def drain_and_stop(self, gate: ServingGate, grace_s: float) -> None:
        """Stop serving within ``grace_s``, losing no call and no answer.

        First a lame-duck moment: the server still answers (clients that have not yet seen it go, and those whose
        retries land here, get answers, not refusals) until its calls have answered and their clients had
        :data:`DRAIN_SETTLE_S` to read them, for at most a third of ``grace_s`` (2 s at most). gRPC closes a
        connection the moment its last call ends after the server's GOAWAY, and a client still reading a large answer
        then gets a TCP reset in place of the answer's tail. Then the gate refuses lookups and the server stops (its
        GOAWAY sends clients' new calls elsewhere) with what is left of ``grace_s`` for calls still running."""
        deadline = time.monotonic() + grace_s
        pools: tuple[Idle, ...] = (self.pool,) if self.streams is None else (self.pool, self.streams)
        if self.front is not None:
            pools += (self.front,)
        wait_all_idle(pools, DRAIN_SETTLE_S, min(grace_s / 3, 2.0))
        gate.close(DRAINING)
        left = max(0.0, deadline - time.monotonic())
        if self.front is not None:  # the gate refuses its new lookups now: let those in flight answer, then close
            wait_all_idle((self.front,), 0.0, left)
            self.front.close()
        left = max(0.0, deadline - time.monotonic())
        self.server.stop(left).wait(left + 0.5)

def build_grpc_server(
    config: HPSConfig, servicer: EmbeddingServicer, health_servicer: health.HealthServicer, *, reuseport: bool = False,
    role: str = "owner",
) -> ServingGrpc:
    """A thread-pool gRPC server with the EmbeddingService, health and reflection (no port bound yet): unary calls
    on ``grpc_threads()`` handler threads, streaming calls on threads of their own (``max_streams`` of them, and
    :data:`~hps_service.server.stream_lane.REFUSAL_THREADS` for the streams past it, refused at once). gRPC's
    sync server holds a thread for a stream's whole life (its handler blocks for each next request), so a stream on
    the handler pool would take a thread from the unary calls; and a shared pool of both sizes would let unary
    calls spread over more threads than ``grpc_threads()``, which only contend for the GIL. Every streaming method
    (StreamLookup, reflection, health Watch) is on that lane (:mod:`~hps_service.server.stream_lane`). gRPC's limit
    of calls in flight counts streams too: it is ``max_concurrent_requests`` plus ``max_streams``.

    ``reuseport``: let the node's worker processes bind one port together (SO_REUSEPORT; the kernel spreads the
    connections over them). ``role``: the process (``owner``, ``worker-N``) its spans name, with tracing on; then the
    servicer's lookups go through a :class:`~hps_service.server.tracing.TracedReadEngine` too."""
    cfg = config.server
    receive, send = message_limits(config)
    pool = HandlerPool(servicer.metrics.queue_wait, max_workers=cfg.grpc_threads(), thread_name_prefix="grpc")
    streams = HandlerPool(servicer.metrics.queue_wait, max_workers=cfg.max_streams + REFUSAL_THREADS,
                          thread_name_prefix="grpc-stream")
    interceptors = grpc_tracing(servicer, role)
    server = grpc.server(
        pool,
        interceptors=[LanePool(streams), *interceptors] if interceptors else [],
        maximum_concurrent_rpcs=cfg.max_concurrent_requests + cfg.max_streams,
        options=[
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", send),
            ("grpc.so_reuseport", 1 if reuseport else 0),
            *grpc_connection_options(cfg),
        ],
    )
    laned = Registrar(server, StreamLane(cfg, streams, servicer.auth, servicer.stream_refused))
    add_embedding_service(servicer, laned)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, laned)
    reflection.enable_server_reflection(
        (pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME),
        laned,
    )
    return ServingGrpc(server, pool, streams)

