"""Open StreamLookup calls on threads of their own, beside the unary handler threads, and at most
``server.max_streams`` of them at once: an open stream never takes a thread a unary call needs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

#: The method whose calls run on the stream lane.
STREAM_METHOD = "/hps.v1.EmbeddingService/StreamLookup"
#: Threads of the stream lane beyond ``max_streams``: a stream past the limit runs there for the moment it takes to
#: be refused, never behind the open streams (which hold at most ``max_streams`` threads).
REFUSAL_THREADS = 2


class _OnPool:
    """A handler behavior that gRPC's sync server runs on ``experimental_thread_pool`` instead of the server's own
    pool (its per-method pool hook: ``grpc._server._select_thread_pool_for_behavior``)."""

    def __init__(self, behavior: Callable[..., Any], pool: futures.ThreadPoolExecutor) -> None:
        self._behavior = behavior
        self.experimental_thread_pool = pool

    def __call__(self, *args: Any) -> Any:
        return self._behavior(*args)


def on_pool(behavior: Callable[..., Any], pool: futures.ThreadPoolExecutor | None) -> Callable[..., Any]:
    """``behavior`` run on ``pool`` by gRPC (unchanged when ``pool`` is None)."""
    return behavior if pool is None else _OnPool(behavior, pool)


class StreamLane(grpc.ServerInterceptor):
    """The outermost interceptor when a server has others (tracing): they wrap each call's behavior in a function
    of their own, which loses the pool :func:`on_pool` gave StreamLookup's; this gives it back."""

    def __init__(self, pool: futures.ThreadPoolExecutor) -> None:
        self._pool = pool

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method != STREAM_METHOD or handler.stream_stream is None:
            return handler
        return grpc.stream_stream_rpc_method_handler(
            on_pool(handler.stream_stream, self._pool), request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


class StreamSlots:
    """The open streams of a serving process: :meth:`take` admits one while fewer than ``limit`` are open."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open = 0

    def take(self) -> bool:
        """Admit a stream (True), or refuse it: ``limit`` are open."""
        with self._lock:
            if self._open >= self.limit:
                return False
            self._open += 1
            return True

    def give_back(self) -> None:
        """A stream admitted by :meth:`take` ended."""
        with self._lock:
            self._open -= 1

    def refusal(self) -> str:
        """Why a stream was refused: the limit and its key."""
        return (f"{self.limit} streams are open on this serving process, the most server.max_streams={self.limit} "
                "allows; close one, or send unary Lookup calls")
