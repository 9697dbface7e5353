"""Every streaming call of a serving process on the stream lane: StreamLookup, reflection's ServerReflectionInfo and
health Watch. gRPC's sync server holds a thread for a blocking stream's whole life, so on the handler pool two idle
streams could take every thread a unary Lookup needs; on the lane they run on threads of their own, at most
``server.max_streams`` open at once and ``server.max_streams_per_caller`` per caller (RESOURCE_EXHAUSTED past
either, refused at once), and a stream idle for ``server.stream_idle_timeout_s`` is closed.

A health Watch answers from callbacks and holds no thread; hps-client keeps one open on every connection (gRPC's
client-side health checking), so watches are bounded apart, by ``server.max_watches`` (a quarter per caller), and
never closed for idling: an ended Watch puts the client's connection in TRANSIENT_FAILURE until it watches again
(gRFC A17), and a Watch is idle by design (it answers changes). It ends with its connection
(``server.max_connection_age_s``).

Services are registered through :class:`~hps_service.server.registration.Registrar`, which puts each streaming
method on the lane as it is added (unary methods stay as they are: nothing of this runs on a unary call)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from hps_service.config import ServerConfig
from hps_service.server.auth import Authenticator
from hps_service.server.idle_streams import IdleStreams
from hps_service.server.status import NO_RETRY
from hps_service.server.stream_slots import StreamSlots, stream_caller

#: Threads of the stream lane beyond ``max_streams``: a stream past the limit runs there for the moment it takes to
#: be refused, never behind the open streams (which hold at most ``max_streams`` threads).
REFUSAL_THREADS = 2


class _OnPool:
    """A handler behavior that gRPC's sync server runs on ``experimental_thread_pool`` instead of the server's own
    pool (its per-method pool hook: ``grpc._server._select_thread_pool_for_behavior``)."""

    def __init__(self, behavior: Callable[..., Any], pool: futures.ThreadPoolExecutor) -> None:
        self._behavior = behavior
        self.experimental_thread_pool = pool
        # a behavior that answers through a callback (health Watch) holds no thread: kept so
        self.experimental_non_blocking = getattr(behavior, "experimental_non_blocking", False)

    def __call__(self, *args: Any) -> Any:
        return self._behavior(*args)


def on_pool(behavior: Callable[..., Any], pool: futures.ThreadPoolExecutor | None) -> Callable[..., Any]:
    """``behavior`` run on ``pool`` by gRPC (unchanged when ``pool`` is None)."""
    return behavior if pool is None else _OnPool(behavior, pool)


def streams(handler: grpc.RpcMethodHandler[Any, Any]) -> bool:
    """Whether a method streams either way."""
    return bool(handler.request_streaming or handler.response_streaming)


def _rebuilt(handler: grpc.RpcMethodHandler[Any, Any], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
             ) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with its behavior wrapped by ``wrap`` (its kind and (de)serializers kept)."""
    make: Any
    behavior: Any
    if handler.request_streaming and handler.response_streaming:
        make, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
    elif handler.request_streaming:
        make, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
    else:
        make, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
    made: grpc.RpcMethodHandler[Any, Any] = make(wrap(behavior), request_deserializer=handler.request_deserializer,
                                                 response_serializer=handler.response_serializer)
    return made


class StreamLane:
    """The stream lane of one serving process: its threads, its slots and its idle streams."""

    def __init__(self, cfg: ServerConfig, pool: futures.ThreadPoolExecutor | None, auth: Authenticator | None,
                 refused: Callable[[str], None] = lambda method: None) -> None:
        """``pool``: the lane's threads (None: the server's own); ``auth``: who a caller is, with ``server.auth``
        on; ``refused(method)``: told of each stream refused."""
        self.pool = pool
        self.slots = StreamSlots(cfg.max_streams, cfg.streams_per_caller())
        self.watches = StreamSlots(cfg.max_watches, max(1, cfg.max_watches // 4), "watches",
                                   ("server.max_watches", "a quarter of server.max_watches ({per_caller})"))
        self.idle = IdleStreams(cfg.stream_idle_timeout_s)
        self._auth = auth
        self._refused = refused

    def handler(self, method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        """``handler`` of ``method`` on the lane when it streams either way; a unary one as it is."""
        if not streams(handler):
            return handler
        return _rebuilt(handler, lambda behavior: on_pool(self._laned(method, handler, behavior), self.pool))

    def _admit(self, method: str, context: grpc.ServicerContext, slots: StreamSlots) -> str:
        """The stream's caller, given one of ``slots``; else the call is aborted with RESOURCE_EXHAUSTED (not to be
        retried)."""
        caller = stream_caller(context, self._auth)
        refusal = slots.take(caller)
        if refusal is not None:
            self._refused(method)
            context.set_trailing_metadata(NO_RETRY)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        return caller

    def _laned(self, method: str, handler: grpc.RpcMethodHandler[Any, Any], behavior: Callable[..., Any]) -> Callable[..., Any]:
        """``behavior`` admitted, watched for idleness, and giving its slot back when it ends."""
        request_streaming = handler.request_streaming
        if getattr(behavior, "experimental_non_blocking", False):
            return self._laned_callback(method, behavior)
        if not handler.response_streaming:
            def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                caller = self._admit(method, context, self.slots)
                watched = self.idle.watch(context)
                try:
                    return behavior(watched.requests(requests), context)
                finally:
                    self.idle.forget(watched)
                    self.slots.give_back(caller)
            return stream_unary

        def streaming(argument: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            caller = self._admit(method, context, self.slots)
            watched = self.idle.watch(context)
            try:
                for response in behavior(watched.requests(argument) if request_streaming else argument, context):
                    watched.touch()
                    yield response
                    watched.touch()  # the answer went out: idle from here
            finally:
                self.idle.forget(watched)
                self.slots.give_back(caller)
        return streaming

    def _laned_callback(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """A behavior that answers through gRPC's callback and returns at once (health Watch), counted in the
        watches: its slot is given back when the call ends, whenever that is."""
        def streaming(request: Any, context: grpc.ServicerContext, send: Callable[[Any], None]) -> None:
            caller = self._admit(method, context, self.watches)
            ended: list[bool] = []

            def end() -> None:
                if not ended:
                    ended.append(True)
                    self.watches.give_back(caller)

            if not context.add_callback(end):
                end()
                return
            behavior(request, context, send)

        streaming.experimental_non_blocking = True  # type: ignore[attr-defined]  # gRPC's hook, read by getattr
        return streaming


class LanePool(grpc.ServerInterceptor):
    """The outermost interceptor when a server has others (tracing): they wrap each call's behavior in a function
    of their own, which loses the pool the lane gave a streaming method's; this gives it back."""

    def __init__(self, pool: futures.ThreadPoolExecutor) -> None:
        self._pool = pool

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not streams(handler):
            return handler
        return _rebuilt(handler, lambda behavior: on_pool(behavior, self._pool))
