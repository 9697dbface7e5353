"""Tracing of the REST admin API: OpenTelemetry's FastAPI instrumentation (a SERVER span per request, the caller's
``traceparent`` followed; probes and /metrics left out), the engine's lookups in ``hps.lookup`` spans, and the
request id (``X-Request-ID``, checked, or a new one) echoed in the response and carried by the log lines."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.trace import TracerProvider

from hps_service.errors import InvalidArgumentError
from hps_service.runtime.call_context import REQUEST_ID, CallInfo, request_id, serving
from hps_service.server.problems import problem as _error
from hps_service.server.rest import AdminContext, create_app
from hps_service.server.tracing.lookups import TracedEngine

#: Paths not traced: probes and scrapes, every few seconds, would drown the calls (regular expressions).
UNTRACED = "/healthz$,/readyz$,/metrics$"


def traced_rest_app(ctx: AdminContext, provider: TracerProvider) -> FastAPI:
    """The admin API over ``ctx`` with its requests traced."""
    app = create_app(replace(ctx, engine=TracedEngine(ctx.engine, provider)))
    app.add_middleware(RequestIdMiddleware)
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, excluded_urls=UNTRACED,
                                       exclude_spans=["receive", "send"])
    return app


class RequestIdMiddleware:
    """Serves each HTTP request as the current call; a malformed ``X-Request-ID`` is a 400 naming the header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == REQUEST_ID.encode()), None)
        try:
            rid = request_id(given)
        except InvalidArgumentError as err:
            await _error(400, str(err))(scope, receive, send)
            return
        span = trace.get_current_span()
        ctx = span.get_span_context()
        span.set_attribute("hps.request_id", rid)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REQUEST_ID.encode(), rid.encode())]}
            await send(message)

        with serving(CallInfo(rid, trace.format_trace_id(ctx.trace_id) if ctx.is_valid else "")):
            await self.app(scope, receive, send_with_id)
