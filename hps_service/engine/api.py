"""What the front ends and the update path need of an engine, as protocols: the seam between them and its backends.

:class:`ReadEngine` is what a lookup path needs (the gRPC servicer, tracing, a worker's health): every serving
process has one, the owner's :class:`~hps_service.engine.engine.LookupEngine` and each node worker's
:class:`~hps_service.node.worker_engine.WorkerEngine` alike. :class:`Engine` adds what only the process that writes
the tiers has: registrations, writes, positions and statistics (the REST admin API, the update consumer, admin jobs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from hps_service.config import ModelConfig
from hps_service.engine.levels import LookupResult
from hps_service.engine.stats import TableStats
from hps_service.engine.table import ServedTable
from hps_service.engine.write import TableChange
from hps_service.tiers.base import Positions, Tier, WriteResult


class ReadEngine(Protocol):
    """Lookups of the served models, with the tiers' health: what every serving process answers calls with."""

    max_batch_keys: int

    def table(self, model: str, table: str) -> ServedTable:
        """The served table (NotFoundError naming what is missing)."""
        ...

    def resolve(self, model: str, version: int | None = None, label: str = "") -> tuple[str, int]:
        """The served name (``model`` or ``model#vN``) and version that a lookup naming ``version`` (0: the model as
        configured) or ``label`` (neither: the label ``production``, else the model as configured) reads."""
        ...

    def lookup(self, model: str, table: str, keys: np.ndarray, out: np.ndarray | None = None,
               sources: np.ndarray | None = None, stored: bool = False) -> LookupResult:
        """Rows of ``keys`` in request order and the level that answered each (``stored``: as the table stores
        them, ``(n, words)``, instead of float32 ``(n, dim)``)."""
        ...

    def model(self, name: str) -> ModelConfig:
        """The loaded model's config (NotFoundError when it is not loaded)."""
        ...

    def models(self) -> list[ModelConfig]:
        """The loaded models."""
        ...

    def healthy(self) -> dict[str, bool]:
        """Reachability of each enabled tier."""
        ...

    def memory_bytes(self) -> dict[str, int]:
        """The persistent tier's memtables and block cache, in bytes."""
        ...


class Engine(ReadEngine, Protocol):
    """A read engine that also owns the tiers: it loads models, applies writes and reports statistics."""

    volatile: Tier | None
    persistent: Tier | None

    def register_model(self, model: ModelConfig) -> None: ...

    def unregister_model(self, name: str) -> None: ...

    def apply_updates(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray,
                      versions: np.ndarray | int) -> int: ...

    def apply_deletes(self, model: str, table: str, keys: np.ndarray,
                      versions: np.ndarray | int | None = None) -> int: ...

    def import_rows(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, version: int = 0,
                    progress: Callable[[int], None] | None = None) -> int: ...

    def check_change(self, change: TableChange) -> None: ...

    def apply_changes(self, changes: Sequence[TableChange],
                      positions: Positions | None = None) -> list[WriteResult]: ...

    def positions(self) -> dict[tuple[str, int], int]: ...

    def stores_positions(self) -> bool: ...

    def purge_tombstones(self, model: str, table: str, below_version: int) -> dict[str, int]: ...

    def table_stats(self, model: str, table: str) -> TableStats: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self, timeout_s: float = 30.0) -> bool: ...
