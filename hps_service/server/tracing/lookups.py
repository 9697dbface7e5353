"""An ``hps.lookup`` span around each table's lookup, a child of the call's span, with what the lookup did: model,
table, keys, hits per tier and misses (keys answered with the table's default).

The wrappers spell out every method of the engine protocols they implement (:mod:`hps_service.engine.api`), so a
method added to a protocol is a type error here until it is traced or passed through on purpose: never passed
through unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from hps_service.config import ModelConfig
from hps_service.engine.api import Engine, ReadEngine
from hps_service.engine.bags import MEAN, Bags
from hps_service.engine.levels import CACHE, DEFAULT, PERSISTENT, VOLATILE, LookupResult
from hps_service.engine.stats import TableStats
from hps_service.engine.table import ServedTable
from hps_service.engine.version_states import VersionView
from hps_service.engine.write import PreparedChange, PutCounts, TableChange
from hps_service.tiers.base import Positions, WriteResult

if TYPE_CHECKING:
    from hps_service.engine.convert import ConvertProgress

#: Span attributes, and the Source code each counts.
HITS = (("hps.hits.cache", CACHE), ("hps.hits.volatile", VOLATILE), ("hps.hits.persistent", PERSISTENT),
        ("hps.misses", DEFAULT))


class TracedReadEngine(ReadEngine):
    """The read engine a traced server's handlers call: :meth:`lookup` in an ``hps.lookup`` span, the rest passed
    through. Used only with tracing on, so an untraced server's lookups pay nothing for it."""

    def __init__(self, engine: ReadEngine, provider: TracerProvider) -> None:
        self._read = engine
        self._tracer = trace.get_tracer("hps_service.engine", tracer_provider=provider)
        self.max_batch_keys = engine.max_batch_keys

    def lookup(self, model: str, table: str, keys: np.ndarray, out: np.ndarray | None = None,
               sources: np.ndarray | None = None, stored: bool = False) -> LookupResult:
        """The engine's lookup, recorded in a span when the call is sampled (an unsampled call makes no span)."""
        if not trace.get_current_span().is_recording():
            return self._read.lookup(model, table, keys, out, sources, stored)
        with self._tracer.start_as_current_span("hps.lookup", kind=trace.SpanKind.INTERNAL) as span:
            span.set_attributes({"hps.model": model, "hps.table": table, "hps.keys": int(keys.shape[0])})
            result = self._read.lookup(model, table, keys, out, sources, stored)
            counts = np.bincount(result.sources, minlength=DEFAULT + 1)
            span.set_attributes({name: int(counts[code]) for name, code in HITS})
            return result

    def lookup_bags(self, model: str, table: str, keys: np.ndarray, bags: Bags, out: np.ndarray | None = None,
                    sources: np.ndarray | None = None) -> LookupResult:
        """The engine's pooled lookup, in an ``hps.lookup`` span with the bags' count when sampled."""
        if not trace.get_current_span().is_recording():
            return self._read.lookup_bags(model, table, keys, bags, out, sources)
        with self._tracer.start_as_current_span("hps.lookup", kind=trace.SpanKind.INTERNAL) as span:
            span.set_attributes({"hps.model": model, "hps.table": table, "hps.keys": int(keys.shape[0]),
                                 "hps.bags": bags.count, "hps.combiner": "mean" if bags.combiner == MEAN else "sum"})
            return self._read.lookup_bags(model, table, keys, bags, out, sources)

    def table(self, model: str, table: str) -> ServedTable:
        return self._read.table(model, table)

    def resolve(self, model: str, version: int | None = None, label: str = "") -> tuple[str, int]:
        return self._read.resolve(model, version, label)

    def model(self, name: str) -> ModelConfig:
        return self._read.model(name)

    def models(self) -> list[ModelConfig]:
        return self._read.models()

    def healthy(self) -> dict[str, bool]:
        return self._read.healthy()

    def memory_bytes(self) -> dict[str, int]:
        return self._read.memory_bytes()


class TracedEngine(TracedReadEngine, Engine):
    """The owner's engine as the traced REST API calls it: lookups traced, every other method passed through."""

    def __init__(self, engine: Engine, provider: TracerProvider) -> None:
        super().__init__(engine, provider)
        self._engine = engine
        self.volatile, self.persistent, self.labels = engine.volatile, engine.persistent, engine.labels
        self.states = engine.states

    def register_model(self, model: ModelConfig) -> None:
        self._engine.register_model(model)

    def unregister_model(self, name: str) -> None:
        self._engine.unregister_model(name)

    def add_version(self, model: ModelConfig, source: str = "") -> list[int]:
        return self._engine.add_version(model, source)

    def drop_version(self, model: str, version: int) -> dict[str, int]:
        return self._engine.drop_version(model, version)

    def finish_drop(self, name: str, tables: dict[str, str]) -> dict[str, int]:
        return self._engine.finish_drop(name, tables)

    def served_models(self) -> list[ModelConfig]:
        return self._engine.served_models()

    def versions(self, model: str) -> list[ModelConfig]:
        return self._engine.versions(model)

    def not_switchable(self, model: str, version: int, allow_empty: bool = False) -> list[str]:
        return self._engine.not_switchable(model, version, allow_empty)

    def version_states(self, model: str) -> list[VersionView]:
        return self._engine.version_states(model)

    def set_label(self, model: str, label: str, version: int | None) -> int | None:
        return self._engine.set_label(model, label, version)

    def writing(self, model: str, table: str) -> AbstractContextManager[ServedTable]:
        return self._engine.writing(model, table)

    def apply_updates(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray,
                      versions: np.ndarray | int, written_s: np.ndarray | None = None) -> int:
        return self._engine.apply_updates(model, table, keys, vectors, versions, written_s)

    def put_rows(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int,
                 strict: bool = False) -> PutCounts:
        return self._engine.put_rows(model, table, keys, vectors, versions, strict)

    def apply_deletes(self, model: str, table: str, keys: np.ndarray,
                      versions: np.ndarray | int | None = None) -> int:
        return self._engine.apply_deletes(model, table, keys, versions)

    def import_rows(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, version: int = 0,
                    progress: Callable[[int], None] | None = None) -> int:
        return self._engine.import_rows(model, table, keys, vectors, version, progress)

    def check_change(self, change: TableChange) -> PreparedChange:
        return self._engine.check_change(change)

    def apply_changes(self, changes: Sequence[TableChange | PreparedChange],
                      positions: Positions | None = None) -> list[WriteResult]:
        return self._engine.apply_changes(changes, positions)

    def positions(self) -> dict[tuple[str, int], int]:
        return self._engine.positions()

    @property
    def stores_positions(self) -> bool:
        return self._engine.stores_positions

    def purge_tombstones(self, model: str, table: str, below_version: int) -> dict[str, int]:
        return self._engine.purge_tombstones(model, table, below_version)

    def check_conversion(self, model: str, table: str, storage: str) -> None:
        self._engine.check_conversion(model, table, storage)

    def convert_table(self, model: str, table: str, storage: str,
                      progress: ConvertProgress | None = None) -> dict[str, Any]:
        return self._engine.convert_table(model, table, storage, progress)

    def table_stats(self, model: str, table: str) -> TableStats:
        return self._engine.table_stats(model, table)

    def stats(self) -> dict[str, Any]:
        return self._engine.stats()

    def close(self, timeout_s: float = 30.0) -> bool:
        return self._engine.close(timeout_s)
