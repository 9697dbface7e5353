"""The one small interface every storage tier implements.

A tier stores versioned float32 rows per table, addressed by int64 key. Tables are named
``"<model>.<table>"`` (see :func:`table_id`). Every method takes and returns whole batches as NumPy
arrays; implementations never loop over keys in Python.

A versioned delete leaves a *tombstone*: the key's version with no vector. ``get`` reports it as not
found, ``count`` does not count it, and a later ``put`` at or below its version is refused, so a replayed
or lagging put (or a promotion of a row read before the delete) never brings a deleted row back.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Flag, auto
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from hps_service.errors import InvalidArgumentError
from hps_service.keys import unique_with_inverse

log = logging.getLogger(__name__)

#: Version stored with a row when the writer gives none (bulk import without a version).
NO_VERSION = 0


#: How far a writer has applied an ordered log: ``(source, partition) -> next offset``. Opaque to the tiers, which
#: only keep it beside the rows (the update consumer uses Kafka topics as sources).
Positions = Mapping[tuple[str, int], int]


class TierCapability(Flag):
    """What a tier can do beyond reads, as data that callers ask (``X in tier.capabilities``) instead of testing the
    tier's class. Each capability but WRITES names the :class:`Tier` method that a tier declaring it implements; a
    tier without WRITES refuses every write, a bulk import included."""

    WRITES = auto()  # put, delete and write change the store (absent: a read-only view, whose writes raise)
    CHECKPOINT = auto()  # checkpoint(): a consistent copy of the whole store in a directory (local snapshots)
    EXPORT = auto()  # export(): some tables with their log positions, as a directory (bucket snapshots)
    BULK_IMPORT = auto()  # bulk_import(): an all-or-nothing load of a table's rows (import jobs)
    SCAN = auto()  # scan(): every stored entry of a table, rows and tombstones, in key order (format conversions)


def check_positions(keys: np.ndarray, positions: np.ndarray, out: np.ndarray, words: int) -> None:
    """InvalidArgumentError unless :meth:`Tier.fill`'s arguments fit: ascending ``positions`` inside ``keys``, and
    ``out`` a C-contiguous float32 ``(len(keys), words)`` (a compiled fill writes where they say, unchecked)."""
    n = keys.shape[0]
    if positions.shape[0] and (positions[0] < 0 or positions[-1] >= n):
        raise InvalidArgumentError(f"fill positions must lie in [0, {n})")
    if out.dtype != np.float32 or out.shape != (n, words) or not out.flags.c_contiguous:
        raise InvalidArgumentError(f"fill needs a C-contiguous float32 out of shape ({n}, {words}), got "
                                   f"{out.dtype} {out.shape}")


def tier_can(tier: ReadTier | None, needs: TierCapability) -> TypeGuard[Tier]:
    """Whether ``tier`` has every capability in ``needs``; a disabled tier (None) has none."""
    return tier is not None and needs in tier.capabilities


def table_id(model: str, table: str) -> str:
    """The tier-level name of a model's table. Names never contain '.', so this is unambiguous."""
    return f"{model}.{table}"


@dataclass(slots=True)
class Rows:
    """The answer of a batch get: one entry per asked key, in the order asked."""

    vectors: np.ndarray  # (n, dim) float32; rows where found is False are undefined
    versions: np.ndarray  # (n,) int64; undefined where found is False
    found: np.ndarray  # (n,) bool

    @classmethod
    def empty(cls, n: int, dim: int) -> Rows:
        return cls(
            vectors=np.zeros((n, dim), dtype=np.float32),
            versions=np.zeros(n, dtype=np.int64),
            found=np.zeros(n, dtype=bool),
        )


@dataclass(slots=True)
class TierStats:
    """Row counts and tier-internal counters for one table (hits and misses are counted by the engine)."""

    rows: int
    capacity: int | None  # None: unbounded
    evictions: int = 0
    errors: int = 0  # batches or keys that failed and fell through to the next tier
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class StoredEntries:
    """A stretch of a table's stored entries in the store's key order: rows and tombstones, with their versions."""

    keys: np.ndarray  # (n,) int64
    live: np.ndarray  # (n,) bool: a row; else a tombstone
    versions: np.ndarray  # (n,) int64
    vectors: np.ndarray  # (n, dim) float32 rows as stored (zeros where a tombstone)

    def write(self, table: str, vectors: np.ndarray) -> TableWrite:
        """These entries as a write of ``table``: the rows (``vectors``, one per live entry) and the tombstones."""
        return TableWrite(table=table, keys=self.keys[self.live], vectors=vectors, versions=self.versions[self.live],
                          delete_keys=self.keys[~self.live], delete_versions=self.versions[~self.live])


@dataclass(slots=True)
class TableWrite:
    """Puts and deletes of one table that are written together; a key is either put or deleted, never both."""

    table: str
    keys: np.ndarray  # (n,) int64, unique
    vectors: np.ndarray  # (n, dim) float32
    versions: np.ndarray  # (n,) int64
    delete_keys: np.ndarray  # (m,) int64, unique
    delete_versions: np.ndarray | None  # (m,) int64 tombstone versions, or None for deletes that forget the key


@dataclass(slots=True)
class WriteResult:
    """What one :class:`TableWrite` did: the mask of puts written and how many live rows the deletes removed."""

    written: np.ndarray  # (n,) bool
    removed: int


def max_version_per_key(keys: np.ndarray, versions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique ``keys`` (sorted) and, for each, the highest of its ``versions`` (deletes of one batch merge)."""
    uniq, inverse = unique_with_inverse(keys)
    if uniq.shape[0] == keys.shape[0]:
        out = np.empty(uniq.shape[0], dtype=np.int64)
        out[inverse] = versions
        return uniq, out
    out = np.full(uniq.shape[0], np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(out, inverse, versions)
    return uniq, out


def delete_versions(versions: np.ndarray | int | None, n: int) -> np.ndarray | None:
    """Validated tombstone versions for ``n`` keys: None, or an (n,) int64 array (a scalar is broadcast)."""
    if versions is None:
        return None
    arr = np.asarray(versions)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"delete versions must be integers (int64), got dtype {arr.dtype}")
    if arr.ndim == 0:
        return np.full(n, int(arr), dtype=np.int64)
    if arr.shape != (n,):
        raise InvalidArgumentError(f"delete versions must have shape ({n},) for {n} keys, got {arr.shape}")
    return arr.astype(np.int64, copy=False)


class MissedWrites:
    """Keys whose writes could not reach a store, per table, kept until the engine takes them for repair.

    Bounded: past ``limit`` keys in all, further misses are dropped and logged (those rows may then stay stale).
    """

    def __init__(self, what: str, limit: int = 10_000_000) -> None:
        self._what = what
        self._limit = limit
        self._parts: dict[str, list[np.ndarray]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def add(self, table: str, keys: np.ndarray) -> None:
        keys = np.array(keys, dtype=np.int64, copy=True).ravel()
        if keys.size == 0:
            return
        with self._lock:
            if self._held + keys.size > self._limit:
                log.error("%s: more than %d missed writes; not tracking more (some rows may stay stale)",
                          self._what, self._limit)
                return
            self._parts.setdefault(table, []).append(keys)
            self._held += keys.size

    def take(self, table: str) -> np.ndarray:
        """The unique missed keys of ``table``, forgotten here."""
        with self._lock:
            parts = self._parts.pop(table, [])
            self._held -= sum(p.size for p in parts)
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)


#: ``lane(keys, out, sources, miss) -> (hits, complete)``: a tier's compiled pass over one table (:meth:`ReadTier.lane`).
LaneRead = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[int, bool]]


class ReadTier(ABC):
    """Reads of a batch key-value store of versioned embedding rows: what a process that does not own the store
    (a node's worker) has of it."""

    #: Short name used in stats and logs: "volatile" or "persistent".
    kind: str = "tier"
    #: True when the tier lives in this process's memory (it is filled from the persistent tier at model load).
    in_process: bool = False
    #: What the tier can do beyond reads: every tier class declares its own (see :class:`TierCapability`).
    capabilities: TierCapability

    @abstractmethod
    def get(self, table: str, keys: np.ndarray) -> Rows:
        """Look up ``keys`` (int64, 1-D). Missing keys have ``found == False``; never raises for a miss."""

    def fill(self, table: str, keys: np.ndarray, positions: np.ndarray, out: np.ndarray, versions: np.ndarray,
             found: np.ndarray) -> int:
        """Fill only the holes (HugeCTR's ``fetch``): the stored row of each key ``keys[positions[j]]`` this tier
        holds goes into ``out[positions[j]]``, its version into ``versions[j]``, and ``found[j]`` says whether it was
        held; returns how many were. ``positions`` ascend, as ``np.flatnonzero`` gives them. This default asks
        :meth:`get` once per distinct key; the in-process tiers read straight into ``out`` in one compiled pass."""
        asked = keys[positions]
        uniq, inverse = unique_with_inverse(asked)
        got = self.get(table, uniq)
        np.take(got.found, inverse, out=found)
        np.take(got.versions, inverse, out=versions)
        hit = np.flatnonzero(found)
        out[positions[hit]] = got.vectors[inverse[hit]]
        return int(hit.shape[0])

    def lane(self, table: str) -> LaneRead | None:
        """The compiled pass over ``table`` from a lookup's keys to its answer's rows (see
        :mod:`hps_service.tiers.hashmap.lane`), or None where the tier has none (then :meth:`fill`)."""
        return None

    def healthy(self) -> bool:
        """Whether the tier can currently serve (used by readiness)."""
        return True

    def memory_bytes(self) -> dict[str, int]:
        """Memory the store holds in this process beside its rows' own accounting: its write buffers (memtables)
        and its block cache, in bytes; zeros for a store with neither."""
        return {"memtables": 0, "block_cache": 0}

    @abstractmethod
    def close(self) -> None:
        """Release connections, files and memory."""


class Tier(ReadTier):
    """A batch key-value store of versioned embedding rows, written by the process that owns it."""

    @abstractmethod
    def create_table(self, table: str, dim: int) -> None:
        """Make ``table`` ready to hold rows of width ``dim`` (idempotent; dim must match if it exists)."""

    @abstractmethod
    def put(self, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Upsert rows, keeping a stored row whose version is newer than the offered one.

        Returns a bool mask of the rows written. Keys within one batch are unique.
        """

    @abstractmethod
    def delete(self, table: str, keys: np.ndarray, versions: np.ndarray | None = None) -> int:
        """Remove ``keys``; returns how many live rows were removed.

        With ``versions`` (int64, one per key or a scalar): only rows whose version is <= the delete's are
        removed, and a tombstone at the delete's version stays (an existing newer tombstone is kept).
        Without (admin deletes, cache invalidation): the key is forgotten, row and tombstone alike.
        """

    @abstractmethod
    def count(self, table: str) -> int:
        """Live rows held for ``table``, tombstones excluded (an estimate where the store only offers one)."""

    @abstractmethod
    def stats(self, table: str) -> TierStats:
        """Rows, capacity and internal counters of ``table``."""

    def scan_keys(self, table: str, limit: int) -> np.ndarray:
        """Up to ``limit`` stored keys of ``table`` in the store's own order (used for cache warm start)."""
        raise NotImplementedError(f"{type(self).__name__} cannot scan keys")

    def accepts(self, table: str, keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Where a put of ``keys`` (unique) at ``versions`` would be written, without writing: no stored row is newer.
        This default reads the live rows with :meth:`get`; a store that can see its tombstones overrides it."""
        rows = self.get(table, keys)
        return ~(rows.found & (rows.versions > np.asarray(versions, dtype=np.int64)))

    def purge_tombstones(self, table: str, below_version: int) -> int:
        """Remove tombstones of ``table`` older than ``below_version``; returns how many. Stores whose
        tombstones are bounded otherwise (evicted with the rows) keep them and return 0."""
        return 0

    #: True when :meth:`write` keeps the positions in the same atomic write as the rows (see :meth:`positions`).
    stores_positions: bool = False

    def write(self, writes: Sequence[TableWrite], positions: Positions | None = None) -> list[WriteResult]:
        """Apply several tables' puts and deletes; a store that ``stores_positions`` writes them and ``positions``
        atomically. This default applies each write in turn and keeps no positions."""
        results = []
        for w in writes:
            written = (self.put(w.table, w.keys, w.vectors, w.versions) if w.keys.shape[0]
                       else np.zeros(0, dtype=bool))
            removed = self.delete(w.table, w.delete_keys, w.delete_versions) if w.delete_keys.shape[0] else 0
            results.append(WriteResult(written=written, removed=removed))
        return results

    def positions(self) -> dict[tuple[str, int], int]:
        """The positions stored by the last :meth:`write` that carried them (empty for stores that keep none)."""
        return {}

    def metadata(self, prefix: str = "") -> dict[str, bytes]:
        """Entries the layers above stored with :meth:`set_metadata` (e.g. runtime model registrations)."""
        return {}

    def set_metadata(self, key: str, value: bytes | None) -> bool:
        """Store (or with None remove) an entry durably; False where the store keeps no metadata."""
        return False

    def complete_token(self, table: str) -> int:
        """How often ``table`` lost its complete state so far (see :mod:`hps_service.tiers.hashmap.complete`): what
        :meth:`mark_complete` compares with. Tiers that are never complete answer 0."""
        return 0

    def mark_complete(self, table: str, token: int) -> bool:
        """Declare that the tier holds every stored row of ``table``, unless it lost that state since ``token`` was
        taken; whether it is complete now. Tiers that cannot be complete answer False."""
        return False

    def is_complete(self, table: str) -> bool:
        """Whether the tier holds every stored row of ``table`` now (:meth:`mark_complete`)."""
        return False

    def lose_complete(self, table: str) -> None:
        """Before something that may leave a stored row out of the tier (an import, a conversion's switch): the
        table is no longer complete."""

    def take_missed_writes(self, table: str) -> np.ndarray:
        """Keys whose puts or deletes could not reach the store and that it may now serve stale: the engine
        rewrites them from the persistent tier. Stores that cannot miss a write return nothing."""
        return np.empty(0, dtype=np.int64)

    def checkpoint(self, dest: Path) -> None:
        """A consistent copy of the whole store at ``dest`` (which must not exist); tiers with CHECKPOINT."""
        raise NotImplementedError(f"{type(self).__name__} cannot checkpoint")

    def export(
        self, dest: Path, tables: Sequence[str], sources: Collection[str], metadata_keys: Collection[str] = ()
    ) -> dict[str, Any]:
        """A copy of ``tables`` with the positions of ``sources`` and the metadata entries ``metadata_keys`` at ``dest``,
        and a description of what it holds; tiers with EXPORT."""
        raise NotImplementedError(f"{type(self).__name__} cannot export tables")

    def bulk_import(
        self, table: str, keys: np.ndarray, vectors: np.ndarray, version: int = NO_VERSION,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Load rows all or nothing, never over a newer stored row; returns rows written. Tiers with BULK_IMPORT."""
        raise NotImplementedError(f"{type(self).__name__} cannot bulk-import")

    def scan(self, table: str, after: int | None, limit: int) -> StoredEntries:
        """Up to ``limit`` entries of ``table`` that follow key ``after`` (None: from the first) in the store's order;
        fewer than ``limit`` when the table ends. Tiers with SCAN."""
        raise NotImplementedError(f"{type(self).__name__} cannot scan entries")

    def drop_table(self, table: str) -> None:
        """Forget every row of ``table``."""
        raise NotImplementedError(f"{type(self).__name__} cannot drop tables")


def tier_health(volatile: ReadTier | None, persistent: ReadTier | None) -> dict[str, bool]:
    """Reachability of each enabled tier, by kind (what /v1/health and gRPC health report)."""
    out = {}
    if volatile is not None:
        out["volatile"] = volatile.healthy()
    if persistent is not None:
        out["persistent"] = persistent.healthy()
    return out


def tier_memory(tier: ReadTier | None) -> dict[str, int]:
    """A tier's memtables and block cache in bytes (:meth:`Tier.memory_bytes`; zeros without a tier)."""
    return tier.memory_bytes() if tier is not None else {"memtables": 0, "block_cache": 0}
