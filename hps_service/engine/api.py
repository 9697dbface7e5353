"""What the front ends and the update path need of an engine, as protocols: the seam between them and its backends.

:class:`ReadEngine` is what a lookup path needs (the gRPC servicer, tracing, a worker's health): every serving
process has one, the owner's :class:`~hps_service.engine.engine.LookupEngine` and each node worker's
:class:`~hps_service.node.worker_engine.WorkerEngine` alike. :class:`Engine` adds what only the process that writes
the tiers has: registrations, writes, positions and statistics (the REST admin API, the update consumer, admin jobs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hps_service.config import ModelConfig
from hps_service.engine.bags import Bags
from hps_service.engine.levels import LookupResult
from hps_service.engine.stats import TableStats
from hps_service.engine.table import ServedTable
from hps_service.engine.version_states import VersionStates, VersionView
from hps_service.engine.versions import Labels
from hps_service.engine.write import PreparedChange, PutCounts, TableChange
from hps_service.tiers.base import Positions, Tier, WriteResult

if TYPE_CHECKING:
    from hps_service.engine.convert import ConvertProgress


class ReadEngine(Protocol):
    """Lookups of the served models, with the tiers' health: what every serving process answers calls with."""

    #: The most keys one lookup may ask (``server.max_batch_keys``).
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

    def lookup_bags(self, model: str, table: str, keys: np.ndarray, bags: Bags, out: np.ndarray | None = None,
                    sources: np.ndarray | None = None) -> LookupResult:
        """One row per bag of ``keys`` (:mod:`hps_service.engine.bags`): float32 ``(bags, dim)`` and the deepest
        level that answered each bag, into ``out`` and ``sources`` when given."""
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
    """A read engine that also owns the tiers: it loads models and versions, points labels, applies writes, converts
    tables and reports statistics (the REST admin API, the update consumer, the fleet's registrations, admin jobs).
    :class:`~hps_service.engine.engine.LookupEngine` is the one implementation; a node's owner extends it."""

    #: The tiers (None: disabled) and every model's labels (label -> version).
    volatile: Tier | None
    persistent: Tier | None
    labels: Labels
    #: What each version does beyond its registration (importing, failed, draining) and where it came from.
    states: VersionStates

    # ---- models, versions and labels
    def register_model(self, model: ModelConfig) -> None:
        """Serve ``model`` (or a version of it), replacing what is served under its name."""
        ...

    def unregister_model(self, name: str) -> None:
        """Stop serving a served name (its rows stay stored)."""
        ...

    def add_version(self, model: ModelConfig, source: str = "") -> list[int]:
        """Serve a new version beside the model (``source``: where its rows come from); returns the older versions
        ``keep_versions`` dropped."""
        ...

    def drop_version(self, model: str, version: int) -> dict[str, int]:
        """Stop serving a version and free its rows (FailedPreconditionError while a label names it)."""
        ...

    def finish_drop(self, name: str, tables: dict[str, str]) -> dict[str, int]:
        """Free what a drop interrupted by a crash left of a served name's tables (name -> tier id)."""
        ...

    def served_models(self) -> list[ModelConfig]:
        """Every loaded model and version."""
        ...

    def versions(self, model: str) -> list[ModelConfig]:
        """The loaded versions of ``model``, oldest first."""
        ...

    def not_switchable(self, model: str, version: int, allow_empty: bool = False) -> list[str]:
        """Why a label cannot point at ``version`` yet (empty: it can); ``allow_empty``: a table without rows is no
        reason."""
        ...

    def version_states(self, model: str) -> list[VersionView]:
        """Every version of ``model`` known here, served or not: state, source, rows per table, oldest first."""
        ...

    def set_label(self, model: str, label: str, version: int | None) -> int | None:
        """Point ``label`` at ``version`` (None: remove it); returns the version it named before."""
        ...

    # ---- writes
    def writing(self, model: str, table: str) -> AbstractContextManager[ServedTable]:
        """The served table with its write lock held (writes of one table never interleave across the tiers)."""
        ...

    def apply_updates(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray,
                      versions: np.ndarray | int, written_s: np.ndarray | None = None) -> int:
        """Write rows to every tier (a newer stored version is kept); returns rows written."""
        ...

    def put_rows(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int,
                 strict: bool = False) -> PutCounts:
        """:meth:`apply_updates` saying rows written and rows stale (a newer stored row kept); ``strict``:
        FailedPreconditionError, nothing written, when any row is stale."""
        ...

    def apply_deletes(self, model: str, table: str, keys: np.ndarray,
                      versions: np.ndarray | int | None = None) -> int:
        """Delete keys from every tier (versioned: tombstones; else forgotten whatever their version)."""
        ...

    def import_rows(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, version: int = 0,
                    progress: Callable[[int], None] | None = None) -> int:
        """Bulk-load rows into the persistent tier; returns rows written."""
        ...

    def check_change(self, change: TableChange) -> PreparedChange:
        """``change`` checked before anything is written, handed back ready for :meth:`apply_changes`."""
        ...

    def apply_changes(self, changes: Sequence[TableChange | PreparedChange],
                      positions: Positions | None = None) -> list[WriteResult]:
        """Several tables' changes and the log positions they reach, in one atomic persistent write."""
        ...

    def positions(self) -> dict[tuple[str, int], int]:
        """The log positions stored with the rows."""
        ...

    @property
    def stores_positions(self) -> bool:
        """Whether positions survive a restart (they live in the persistent tier)."""
        ...

    def purge_tombstones(self, model: str, table: str, below_version: int) -> dict[str, int]:
        """Remove tombstones older than ``below_version``; how many, per level."""
        ...

    def check_conversion(self, model: str, table: str, storage: str) -> None:
        """Raise the error that says why ``model.table`` cannot be converted to ``storage`` now, if it cannot."""
        ...

    def convert_table(self, model: str, table: str, storage: str,
                      progress: ConvertProgress | None = None) -> dict[str, Any]:
        """Re-encode a served table's rows as ``storage`` while it is served."""
        ...

    # ---- statistics and lifecycle
    def table_stats(self, model: str, table: str) -> TableStats:
        """Per level: hits, misses, hit rate, rows, capacity, evictions."""
        ...

    def stats(self) -> dict[str, Any]:
        """The ``/v1/stats`` shape."""
        ...

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the background work and close the tiers; False when something did not stop in time."""
        ...
