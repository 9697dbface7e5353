"""Tracing on or off (``server.tracing``): what a serving process's gRPC server and REST app get from it. The otel
extra (:mod:`hps_service.server.tracing`) is imported only when tracing is on; off, the server runs as if none of
this existed."""

from __future__ import annotations

import sys

import grpc
from fastapi import FastAPI

from hps_service.server.grpc_service import EmbeddingServicer
from hps_service.server.rest import AdminContext, create_app

_TRACING = "hps_service.server.tracing"


def grpc_tracing(servicer: EmbeddingServicer, role: str) -> list[grpc.ServerInterceptor]:
    """The server interceptors of a process (``role``: ``owner`` or ``worker-N``, named by its spans): none with
    tracing off; on, the servicer's lookups go through a :class:`~hps_service.server.tracing.TracedReadEngine` too."""
    cfg = servicer.limits.tracing
    if not cfg.enabled:
        return []
    from hps_service.server import tracing

    provider = tracing.tracer_provider(cfg, role)
    servicer.engine = tracing.TracedReadEngine(servicer.engine, provider)
    return tracing.grpc_interceptors(provider)


def admin_app(ctx: AdminContext) -> FastAPI:
    """The admin API over ``ctx``, its requests traced with tracing on."""
    cfg = ctx.config.server.tracing
    if not cfg.enabled:
        return create_app(ctx)
    from hps_service.server import tracing

    return tracing.traced_rest_app(ctx, tracing.tracer_provider(cfg, "owner"))


def flush_spans() -> None:
    """Export the spans this process still holds, if it traces (a worker leaves with os._exit, skipping atexit)."""
    tracing = sys.modules.get(_TRACING)
    if tracing is not None:
        tracing.flush()
