"""The write path: upserts, deletes and imports through every tier (persistent first, it is the durable one), then
L1; tombstone purges.

A stored row with a newer version is never replaced, so replays and lagging writers are harmless; a versioned
delete leaves a tombstone that refuses older puts. Every method is called with the table's write lock held (see
:meth:`LookupEngine.writing`) and stamps the keys it writes (see :mod:`hps_service.engine.write_guard`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from hps_service.engine import ttl
from hps_service.engine.table import ServedTable
from hps_service.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from hps_service.keys import as_keys
from hps_service.tiers.base import (
    Positions,
    TableWrite,
    Tier,
    TierCapability,
    WriteResult,
    delete_versions,
    max_version_per_key,
    tier_can,
)


@dataclass(slots=True)
class TableChange:
    """Rows and versioned deletes of one table from one stretch of the update log."""

    model: str
    table: str
    keys: np.ndarray
    vectors: np.ndarray
    versions: np.ndarray
    delete_keys: np.ndarray
    delete_versions: np.ndarray
    #: Per row, when it was written (seconds since the epoch: its update message's ``produced_at_ns``), kept with
    #: the row by a table with ``ttl_s``; None: now, by this server's clock.
    written_s: np.ndarray | None = None

    def write(self, t: ServedTable, admit: Admit | None = None) -> TableWrite:
        """The write of this change to ``t``, checked (see :func:`prepare_change`) and resolved."""
        return prepare_change(t, self).write(t, admit)

@dataclass(frozen=True, slots=True)
class PutCounts:
    """What a put did: rows written, and rows not written because the stored row of their key is newer (stale)."""

    written: int
    stale: int


#: Keys per L2 delete and L1 invalidation after an import (bounds one call).
INVALIDATE_CHUNK = 65_536


def as_rows(vectors: np.ndarray, n: int, dim: int, what: str) -> np.ndarray:
    """Validate rows for ``n`` keys of width ``dim``: float32, finite."""
    arr = np.asarray(vectors, dtype=np.float32)
    if arr.shape != (n, dim):
        raise InvalidArgumentError(f"{what}: expected rows of shape ({n}, {dim}), got {arr.shape}")
    if not np.isfinite(arr).all():
        raise InvalidArgumentError(f"{what}: rows contain NaN or infinite values")
    return arr


def latest_per_key(keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """Indices that keep one entry per key: the highest version, the last one among equals."""
    order = np.lexsort((np.arange(keys.shape[0]), versions, keys))
    sorted_keys = keys[order]
    last = np.ones(order.shape[0], dtype=bool)
    last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
    return order[last]


def resolve_latest(
    keys: np.ndarray, versions: np.ndarray, delete_keys: np.ndarray, delete_versions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One winner per key among puts and deletes: the highest version; a delete beats a put at the same version,
    and among equal puts the later one wins. Returns (put indices, delete indices) into the given arrays."""
    n = keys.shape[0]
    all_keys = np.concatenate((keys, delete_keys))
    all_versions = np.concatenate((versions, delete_versions))
    is_delete = np.zeros(all_keys.shape[0], dtype=np.int8)
    is_delete[n:] = 1
    order = np.lexsort((np.arange(all_keys.shape[0]), is_delete, all_versions, all_keys))
    sorted_keys = all_keys[order]
    last = np.ones(order.shape[0], dtype=bool)
    last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
    winners = order[last]
    return winners[winners < n], winners[winners >= n] - n


#: How a writer admits the puts of a table: ``admit(t, keys)`` -> mask of the puts kept, or None for all of them.
Admit = Callable[[ServedTable, np.ndarray], np.ndarray | None]


@dataclass(slots=True)
class PreparedChange:
    """A :class:`TableChange` checked against the table it was prepared for (int64 keys and versions, rows of its
    dim, finite): what :meth:`LookupEngine.check_change` hands back, so that the write does not check it again.
    ``resolved`` is the write itself (one winner per key, rows encoded) where no ingest filter must see the puts."""

    model: str
    table: str
    served: ServedTable
    keys: np.ndarray
    vectors: np.ndarray
    versions: np.ndarray
    written: np.ndarray | None
    delete_keys: np.ndarray
    delete_versions: np.ndarray
    resolved: TableWrite | None = None

    def write(self, t: ServedTable, admit: Admit | None = None) -> TableWrite:
        """The write to ``t``: the one resolved at the check when ``t`` is still the table checked against, else
        its puts passed through ``admit`` (each counted as a write: see ``ingest_admission``) and resolved."""
        if t is not self.served:
            return prepare_change(t, TableChange(self.model, self.table, self.keys, self.vectors, self.versions,
                                                 self.delete_keys, self.delete_versions, self.written)).write(t, admit)
        if self.resolved is not None and (admit is None or t.ingest is None):
            return self.resolved
        keys, vectors, versions, written = self.keys, self.vectors, self.versions, self.written
        if admit is not None and keys.shape[0] and (keep := admit(t, keys)) is not None:
            keys, vectors, versions = keys[keep], vectors[keep], versions[keep]
            written = written[keep] if written is not None else None
        return _resolved(t, keys, vectors, versions, written, self.delete_keys, self.delete_versions)


def prepare_change(t: ServedTable, change: TableChange) -> PreparedChange:
    """``change`` checked against the table (dims, finite rows, int64 keys and versions); raises
    InvalidArgumentError naming the problem. Resolved at once where the table filters no puts at ingest."""
    keys = as_keys(change.keys)
    n = keys.shape[0]
    vectors = as_rows(change.vectors, n, t.dim, f"update of {t.id}") if n else np.empty((0, t.dim), np.float32)
    versions = np.broadcast_to(np.asarray(change.versions, dtype=np.int64), (n,))
    del_keys = as_keys(change.delete_keys)
    del_versions = delete_versions(change.delete_versions, del_keys.shape[0])
    if del_versions is None:
        raise InvalidArgumentError(f"deletes of {t.id} from the log need versions")
    written = ttl.write_times(n, change.written_s) if t.ttl_s is not None else None
    prepared = PreparedChange(change.model, change.table, t, keys, vectors, versions, written, del_keys, del_versions)
    if t.ingest is None:
        prepared.resolved = _resolved(t, keys, vectors, versions, written, del_keys, del_versions)
    return prepared


def _resolved(t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, written: np.ndarray | None,
              del_keys: np.ndarray, del_versions: np.ndarray) -> TableWrite:
    """One winner per key among the puts and deletes, the puts' rows encoded in the table's format."""
    puts, deletes = resolve_latest(keys, versions, del_keys, del_versions)
    stored = t.format.encode(vectors[puts], written[puts] if written is not None else None)
    return TableWrite(table=t.id, keys=keys[puts], vectors=stored, versions=versions[puts],
                      delete_keys=del_keys[deletes], delete_versions=del_versions[deletes])


def copy_write(t: ServedTable, w: TableWrite) -> TableWrite | None:
    """``w`` as it reaches the copy of a conversion in progress (None: none runs, or it stopped). A row the copy's
    format cannot hold stops the conversion, never the write."""
    conv = t.converting
    if conv is None or conv.error is not None:
        return None
    try:
        vectors = conv.reencode(w.vectors)
    except InvalidArgumentError as exc:
        conv.error = f"a write of {t.name} cannot be stored as {conv.format.storage}: {exc}"
        return None
    return TableWrite(table=conv.id, keys=w.keys, vectors=vectors, versions=w.versions, delete_keys=w.delete_keys,
                      delete_versions=w.delete_versions)


class Writer:
    """Applies upserts, deletes and tombstone purges of served tables to every tier and L1. While a table is
    converted (``t.converting``), every write of it also reaches the copy in the persistent tier."""

    def __init__(self, volatile: Tier | None, persistent: Tier | None) -> None:
        self.volatile = volatile
        self.persistent = persistent

    def admitted(self, t: ServedTable, keys: np.ndarray) -> np.ndarray | None:
        """Mask of the puts of ``keys`` that ``t``'s ingest filter admits, each counted as a write (None: the table
        has no filter, every put is admitted); a key the persistent tier (else the volatile one) holds passes."""
        if t.ingest is None:
            return None
        return t.ingest.admit(keys, self.persistent if self.persistent is not None else self.volatile, t.id)

    def apply_updates(
        self, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int,
        written_s: np.ndarray | None = None,
    ) -> int:
        """Write the rows the table admits (see :meth:`admitted`) to persistent (durable) -> volatile -> rows present
        in L1. Returns rows written. ``written_s``: the rows' write times for a table with ``ttl_s`` (None: now)."""
        return self.put(t, keys, vectors, versions, written_s).written

    def put(
        self, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int,
        written_s: np.ndarray | None = None, strict: bool = False,
    ) -> PutCounts:
        """:meth:`apply_updates`, saying how many rows were written and how many were stale (a stored row is
        newer). ``strict``: FailedPreconditionError naming the stale rows, and nothing written, when any is."""
        keys = as_keys(keys)
        n = keys.shape[0]
        vectors = as_rows(vectors, n, t.dim, f"update of {t.id}")
        stamped = np.broadcast_to(np.asarray(versions, dtype=np.int64), (n,))
        if n == 0:
            return PutCounts(0, 0)
        written = ttl.write_times(n, written_s) if t.ttl_s is not None else None
        if (admitted := self.admitted(t, keys)) is not None:
            keys, vectors, stamped = keys[admitted], vectors[admitted], stamped[admitted]
            written = written[admitted] if written is not None else None
            n = keys.shape[0]
            if n == 0:
                return PutCounts(0, 0)
        keep = latest_per_key(keys, stamped)
        if keep.shape[0] != n:
            keys, vectors, stamped = keys[keep], vectors[keep], stamped[keep]
            written = written[keep] if written is not None else None
        else:
            stamped = np.ascontiguousarray(stamped)
        vectors = t.format.encode(vectors, written)  # once: every tier and L1 hold the stored form
        with t.guard.writing(keys):
            if strict:
                self._refuse_stale(t, keys, stamped)
            written_n = self._put_encoded(t, keys, vectors, stamped)
        return PutCounts(written_n, int(keys.shape[0]) - written_n)

    def _refuse_stale(self, t: ServedTable, keys: np.ndarray, versions: np.ndarray) -> None:
        """FailedPreconditionError when the lowest tier holds a row newer than some put (a strict write)."""
        tier = self.persistent if self.persistent is not None else self.volatile
        if tier is None:
            return
        stale = np.flatnonzero(~tier.accepts(t.id, keys, versions))
        if stale.size:
            raise FailedPreconditionError(
                f"{stale.size} of {keys.shape[0]} rows are older than the rows stored for their keys (key "
                f"{int(keys[stale[0]])} at version {int(versions[stale[0]])}, for one); nothing was written "
                "(strict)")

    def _put_encoded(self, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, stamped: np.ndarray) -> int:
        """Write unique encoded rows to every tier and L1 (the caller holds the write guard); rows written."""
        written = np.ones(keys.shape[0], dtype=bool)
        if self.persistent is not None:
            written = self.persistent.put(t.id, keys, vectors, stamped)
            if t.converting is not None and (copy := copy_write(t, _rows_write(t, keys, vectors, stamped))):
                self.persistent.put(copy.table, copy.keys, copy.vectors, copy.versions)
        if self.volatile is not None:
            if self.persistent is None:
                written = self.volatile.put(t.id, keys, vectors, stamped)
            elif written.any():
                # only rows L3 accepted: an older replay must not reach L2 where an evicted tombstone left a gap
                self.volatile.put(t.id, keys[written], vectors[written], stamped[written])
        if t.cache is not None and written.any():
            t.cache.update(keys[written], vectors[written], stamped[written])
        return int(np.count_nonzero(written))

    def apply_deletes(self, t: ServedTable, keys: np.ndarray, versions: np.ndarray | int | None = None) -> int:
        """Delete keys from every tier and the L1 cache. Returns how many live rows the lowest enabled tier held.

        With ``versions`` (update tombstones), a tier removes only rows not newer than the delete and keeps a
        tombstone, so a replayed older put or a late promotion cannot bring the row back; without (admin
        deletes), the keys are forgotten whatever their version.
        """
        keys = as_keys(keys)
        tomb_versions = delete_versions(versions, keys.shape[0])
        if keys.shape[0] == 0:
            return 0
        if tomb_versions is None:
            keys = np.unique(keys)
        else:
            keys, tomb_versions = max_version_per_key(keys, tomb_versions)
        removed = 0
        with t.guard.writing(keys):
            if self.persistent is not None:
                removed = self.persistent.delete(t.id, keys, tomb_versions)
                if (conv := t.converting) is not None and conv.error is None:
                    self.persistent.delete(conv.id, keys, tomb_versions)
            if self.volatile is not None:
                n = self.volatile.delete(t.id, keys, tomb_versions)
                if self.persistent is None:
                    removed = n
            if t.cache is not None:
                t.cache.invalidate(keys, tomb_versions)  # versioned: a newer cached row stays
        return removed

    def import_rows(
        self, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, version: int,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Bulk-load rows into the persistent tier (its ``bulk_import``: all or nothing, never older than a stored
        row), then drop their keys from L2 and L1, which read them through again. Into a complete volatile table
        (see :mod:`hps_service.tiers.hashmap.complete`) the rows stored are written instead, and the table is
        complete again if they fit. Returns rows written."""
        if not tier_can(self.persistent, TierCapability.BULK_IMPORT):
            raise UnavailableError("import needs a persistent tier that bulk-loads (persistent.type rocksdb)")
        keys = as_keys(keys)
        with t.guard.writing(keys):
            complete = self.volatile is not None and self.volatile.is_complete(t.id)
            if self.volatile is not None:
                self.volatile.lose_complete(t.id)  # until the rows are in L2, a miss reads L3
            token = self.volatile.complete_token(t.id) if self.volatile is not None else 0
            stored = t.format.encode(as_rows(vectors, keys.shape[0], t.dim, f"import into {t.id}"), ttl.now_s())
            written = int(self.persistent.bulk_import(t.id, keys, stored, version=version, progress=progress))
            versions = np.full(keys.shape[0], version, np.int64)
            if t.converting is not None and (copy := copy_write(t, _rows_write(t, keys, stored, versions))):
                self.persistent.bulk_import(copy.table, copy.keys, copy.vectors, version=version)
            for start in range(0, keys.shape[0], INVALIDATE_CHUNK):
                chunk = keys[start : start + INVALIDATE_CHUNK]
                if self.volatile is not None:
                    if complete:
                        self._store_in_volatile(t, chunk)
                    else:
                        self.volatile.delete(t.id, chunk)
                if t.cache is not None:
                    t.cache.invalidate(chunk)
            if complete and self.volatile is not None:
                self.volatile.mark_complete(t.id, token)  # refused when the rows did not fit (an eviction)
        return written

    def _store_in_volatile(self, t: ServedTable, keys: np.ndarray) -> None:
        """Write into L2 the rows L3 stores for ``keys`` now (an import's, or the newer ones it kept)."""
        assert self.volatile is not None and self.persistent is not None
        got = self.persistent.get(t.id, keys)
        if got.found.any():
            self.volatile.put(t.id, keys[got.found], got.vectors[got.found], got.versions[got.found])
    def apply_changes(
        self, changes: Sequence[tuple[ServedTable, TableWrite]], positions: Positions | None = None
    ) -> list[WriteResult]:
        """Apply several tables' resolved changes (see :class:`PreparedChange`): one atomic persistent write that also
        stores ``positions`` (where the tier keeps them), then the volatile tier, then L1."""
        writes = [w for _, w in changes]
        with ExitStack() as stamped:  # the caller holds the tables' write locks
            for t, w in changes:
                stamped.enter_context(t.guard.writing(np.concatenate((w.keys, w.delete_keys))))
            return self._apply_changes(changes, writes, positions)

    def _apply_changes(
        self, changes: Sequence[tuple[ServedTable, TableWrite]], writes: list[TableWrite], positions: Positions | None
    ) -> list[WriteResult]:
        if self.persistent is not None:
            copies = [c for t, w in changes if (c := copy_write(t, w)) is not None]
            results = self.persistent.write([*writes, *copies], positions)[: len(writes)]  # one atomic batch
        elif self.volatile is not None:
            results = self.volatile.write(writes)
        else:
            results = [WriteResult(written=np.ones(w.keys.shape[0], dtype=bool), removed=0) for w in writes]
        for (t, w), result in zip(changes, results):
            written = result.written
            if self.volatile is not None and self.persistent is not None:
                if written.any():  # only rows L3 accepted (see apply_updates)
                    self.volatile.put(t.id, w.keys[written], w.vectors[written], w.versions[written])
                if w.delete_keys.shape[0]:
                    self.volatile.delete(t.id, w.delete_keys, w.delete_versions)
            if t.cache is not None:
                if written.any():
                    t.cache.update(w.keys[written], w.vectors[written], w.versions[written])
                if w.delete_keys.shape[0]:
                    t.cache.invalidate(w.delete_keys, w.delete_versions)  # versioned: a newer cached row stays
        return results

    def purge_tombstones(self, t: ServedTable, below_version: int) -> dict[str, int]:
        """Remove the tombstones older than ``below_version`` from every tier; returns how many, per level.

        A tombstone only stops a put older than itself, so ``below_version`` must be older than any update the
        log can still deliver (for example the version of the oldest message the topic retains).
        """
        if below_version < 0:
            raise InvalidArgumentError(f"below_version must be >= 0, got {below_version}")
        purged = {level: tier.purge_tombstones(t.id, below_version)
                  for level, tier in (("volatile", self.volatile), ("persistent", self.persistent)) if tier is not None}
        if self.persistent is not None and (conv := t.converting) is not None and conv.error is None:
            self.persistent.purge_tombstones(conv.id, below_version)
        return purged


def _rows_write(t: ServedTable, keys: np.ndarray, stored: np.ndarray, versions: np.ndarray) -> TableWrite:
    """Puts of stored rows of ``t``, as a write of the table."""
    empty = np.zeros(0, dtype=np.int64)
    return TableWrite(table=t.id, keys=keys, vectors=stored, versions=versions, delete_keys=empty,
                      delete_versions=empty)
