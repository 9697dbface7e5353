"""How services are registered on a serving process's gRPC server: each method's requests parsed so that bytes that
are not its message are INVALID_ARGUMENT (:mod:`~hps_service.server.request_parsing`), and each streaming method on
the stream lane (:mod:`~hps_service.server.stream_lane`). A service's generated ``add_*_to_server`` is given a
:class:`Registrar` in place of the server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from hps_service.server.request_parsing import tolerant_handler
from hps_service.server.stream_lane import StreamLane


class _Generic(grpc.GenericRpcHandler):
    """A generic handler whose methods are prepared as the registrar's."""

    def __init__(self, inner: grpc.GenericRpcHandler, lane: StreamLane) -> None:
        self._inner = inner
        self._lane = lane
        self._made: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        made = self._made.get(method)
        if made is None:  # once per method a service has (an unknown method has no handler: never kept)
            made = self._made[method] = prepared(method, handler, self._lane)
        return made


def prepared(method: str, handler: grpc.RpcMethodHandler[Any, Any], lane: StreamLane) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` of ``method`` parsing its requests tolerantly, on the lane when it streams."""
    return lane.handler(method, tolerant_handler(method, handler))


class Registrar:
    """What a service's ``add_*_to_server`` registers with: passed on to ``server``, every method prepared."""

    def __init__(self, server: grpc.Server, lane: StreamLane) -> None:
        self._server = server
        self._lane = lane

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_Generic(h, self._lane) for h in generic_rpc_handlers))

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
        self._server.add_registered_method_handlers(service_name, {
            name: prepared(f"/{service_name}/{name}", h, self._lane) for name, h in method_handlers.items()})
