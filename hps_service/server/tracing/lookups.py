"""An ``hps.lookup`` span around each table's lookup, a child of the call's span, with what the lookup did: model,
table, keys, hits per tier and misses (keys answered with the table's default)."""

from __future__ import annotations

from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from hps_service.engine.api import ReadEngine
from hps_service.engine.levels import CACHE, DEFAULT, PERSISTENT, VOLATILE, LookupResult

#: Span attributes, and the Source code each counts.
HITS = (("hps.hits.cache", CACHE), ("hps.hits.volatile", VOLATILE), ("hps.hits.persistent", PERSISTENT),
        ("hps.misses", DEFAULT))


class TracedEngine:
    """The engine a traced server's handlers call: :meth:`lookup` in an ``hps.lookup`` span, everything else
    passed through. Used only with tracing on, so an untraced server's lookups pay nothing for it."""

    def __init__(self, engine: ReadEngine, provider: TracerProvider) -> None:
        self._engine = engine
        self._tracer = trace.get_tracer("hps_service.engine", tracer_provider=provider)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def lookup(self, model: str, table: str, keys: np.ndarray, out: np.ndarray | None = None,
               sources: np.ndarray | None = None, stored: bool = False) -> LookupResult:
        """The engine's lookup, recorded in a span when the call is sampled (an unsampled call makes no span)."""
        if not trace.get_current_span().is_recording():
            return self._engine.lookup(model, table, keys, out, sources, stored)
        with self._tracer.start_as_current_span("hps.lookup", kind=trace.SpanKind.INTERNAL) as span:
            span.set_attributes({"hps.model": model, "hps.table": table, "hps.keys": int(keys.shape[0])})
            result = self._engine.lookup(model, table, keys, out, sources, stored)
            counts = np.bincount(result.sources, minlength=DEFAULT + 1)
            span.set_attributes({name: int(counts[code]) for name, code in HITS})
            return result
