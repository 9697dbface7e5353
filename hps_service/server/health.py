"""gRPC's health service (grpc.health.v1) without its deadlock: grpcio-health-checking's ``HealthServicer`` sends
Watch responses while holding the lock that a closing Watch's callback needs on gRPC's completion-queue thread, and
a send waits for that thread to report it done, so a ``set`` racing a Watch that ends stops the server for good
(grpc/grpc#43403). Here a status is sent outside that lock, under a lock of its own that keeps the sends in order."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

SendResponse = Callable[[Any], Any]


class HealthServicer(health.HealthServicer):
    """``grpc_health.v1.health.HealthServicer`` (non-blocking Watch), whose sends never hold the watcher lock."""

    def __init__(self) -> None:
        super().__init__()
        #: Held while a status is recorded and sent to its watchers: sends stay in the order the statuses were set.
        self._send_lock = threading.RLock()
        self._gracefully_shutting_down: bool = False  # the base class's flag, typed

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """The service's status; NOT_FOUND naming it when it has none (the stock servicer sends no message)."""
        with self._lock:
            status = self._server_status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no health status for service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,  # noqa: N802
              send_response_callback: SendResponse | None = None) -> Any:
        """Send the service's status now and on every change until the call ends."""
        if send_response_callback is None:  # a server without non-blocking streams: the stock blocking generator
            return super().Watch(request, context)
        service = request.service
        with self._send_lock:
            with self._lock:
                status = self._server_status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                self._send_response_callbacks.setdefault(service, set()).add(send_response_callback)
            if not context.add_callback(self._on_close_callback(send_response_callback, service)):
                with self._lock:  # the call already ended: nothing will remove it
                    self._send_response_callbacks[service].discard(send_response_callback)
                return None
            send_response_callback(health_pb2.HealthCheckResponse(status=status))
        return None

    def set(self, service: str, status: int) -> None:
        """Record ``service``'s status and send it to its watchers (ignored once shutting down)."""
        with self._send_lock:
            with self._lock:
                if self._gracefully_shutting_down:
                    return
                self._server_status[service] = status
                watchers = list(self._send_response_callbacks.get(service, ()))
            for send in watchers:
                send(health_pb2.HealthCheckResponse(status=status))

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good: later ``set`` calls are ignored."""
        with self._send_lock:
            with self._lock:
                if self._gracefully_shutting_down:
                    return
                services = list(self._server_status)
            for service in services:
                self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
            with self._lock:
                self._gracefully_shutting_down = True
