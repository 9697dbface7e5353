"""Tracing of the EmbeddingService's calls: OpenTelemetry's gRPC server interceptor (a SERVER span per call, the
caller's ``traceparent`` followed), then ours: the call's request id (the caller's ``x-request-id``, checked, or a
new one), set on the span and made the current call for the log lines. It is not sent back: initial metadata of
its own would cost every call another batch of gRPC work, and a caller that wants to quote an id sends its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import filters, server_interceptor
from opentelemetry.sdk.trace import TracerProvider

from hps_service.errors import InvalidArgumentError
from hps_service.runtime.call_context import REQUEST_ID, CallInfo, request_id, serving

#: Only lookups and their service are traced: health checks and watches, and reflection, would drown them.
TRACED_SERVICE = "hps.v1.EmbeddingService"


def grpc_interceptors(provider: TracerProvider) -> list[grpc.ServerInterceptor]:
    """The server interceptors of a traced process, outermost first."""
    return [server_interceptor(tracer_provider=provider, filter_=filters.service_name(TRACED_SERVICE)),
            RequestIdInterceptor()]


def _call_info(metadata: Any) -> CallInfo:
    """The call's request id from its metadata (InvalidArgumentError when the caller's is not one) and the trace id
    of the span the OpenTelemetry interceptor made current."""
    given = next((v for k, v in metadata or () if k == REQUEST_ID), None)
    ctx = trace.get_current_span().get_span_context()
    return CallInfo(request_id(given), trace.format_trace_id(ctx.trace_id) if ctx.is_valid else "")


def _begin(context: grpc.ServicerContext) -> CallInfo:
    try:
        call = _call_info(context.invocation_metadata())
    except InvalidArgumentError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    trace.get_current_span().set_attribute("hps.request_id", call.request_id)
    return call


class RequestIdInterceptor(grpc.ServerInterceptor):
    """Serves each EmbeddingService call as the current call (see :mod:`hps_service.runtime.call_context`)."""

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.startswith(f"/{TRACED_SERVICE}/"):
            return handler
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                with serving(_begin(context)):
                    return behavior(request, context)

            return handler._replace(unary_unary=unary)
        if handler.stream_stream is not None:
            streaming = handler.stream_stream

            def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                call = _begin(context)
                with serving(call):
                    yield from streaming(requests, context)

            return handler._replace(stream_stream=stream)
        return handler
