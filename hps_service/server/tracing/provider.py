"""The tracer provider of this process: spans batched and exported over OTLP/gRPC, sampled after the caller's
decision, and named by the process that made them (the owner, or which worker)."""

from __future__ import annotations

import os
import socket
import threading

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from hps_service.config import TracingConfig

#: How long a process waits for its last spans to leave when it stops.
FLUSH_TIMEOUT_S = 5.0

_lock = threading.Lock()
_provider: tuple[int, TracerProvider] | None = None


def tracer_provider(cfg: TracingConfig, role: str) -> TracerProvider:
    """This process's provider (made on first use; ``role``: ``owner`` or ``worker-N``, the ``hps.process``
    attribute of its spans). Not the global provider: nothing else in the process starts exporting because of it."""
    global _provider
    with _lock:
        if _provider is None or _provider[0] != os.getpid():
            resource = Resource.create({
                "service.name": cfg.service_name,
                "service.instance.id": f"{socket.gethostname()}/{role}",
                "process.pid": os.getpid(),
                "hps.process": role,
            })
            provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
            exporter = OTLPSpanExporter(endpoint=cfg.endpoint) if cfg.endpoint else OTLPSpanExporter()
            provider.add_span_processor(
                BatchSpanProcessor(exporter, schedule_delay_millis=cfg.export_interval_s * 1000))
            _provider = (os.getpid(), provider)
        return _provider[1]


def flush() -> None:
    """Export the spans still queued in this process (a worker leaves with os._exit, which skips atexit)."""
    if _provider is not None and _provider[0] == os.getpid():
        _provider[1].force_flush(int(FLUSH_TIMEOUT_S * 1000))
