"""OpenTelemetry tracing of a serving process (``server.tracing``, the ``otel`` extra): a span per gRPC and REST call
from the official instrumentations, the caller's W3C ``traceparent`` followed, an ``hps.lookup`` span per table
looked up with its keys and hits per tier, and the call's request and trace ids in its log lines.

Imported only when tracing is on: a server with tracing off runs none of this on a call."""

from hps_service.config import ConfigError

try:  # before the modules below, so that a missing extra is named rather than met as an ImportError
    import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    import opentelemetry.instrumentation.fastapi  # noqa: F401
    import opentelemetry.instrumentation.grpc  # noqa: F401
    import opentelemetry.sdk.trace  # noqa: F401
except ImportError as exc:
    raise ConfigError(f"server.tracing.enabled needs the otel extra (pip install 'hps-service[otel]'): {exc}") from None

from hps_service.server.tracing.grpc_calls import grpc_interceptors
from hps_service.server.tracing.lookups import TracedEngine, TracedReadEngine
from hps_service.server.tracing.provider import flush, tracer_provider
from hps_service.server.tracing.rest_calls import traced_rest_app

__all__ = ["TracedEngine", "TracedReadEngine", "flush", "grpc_interceptors", "traced_rest_app", "tracer_provider"]
