"""How the RocksDB tier turns puts and deletes into one WriteBatch: each key's stored state read with one multi-get,
rows written only where their version wins, tombstones where a delete carries one, the exact row and tombstone
counts adjusted in the same batch. The tier builds a :class:`WriteStaging` over itself (its :class:`StagedStore`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from itertools import compress, islice, repeat
from typing import Protocol

import numpy as np
from rocksdict import Rdict, WriteBatch

from hps_service.errors import InvalidArgumentError
from hps_service.keys import as_keys
from hps_service.tiers.base import delete_versions, max_version_per_key
from hps_service.tiers.codec import (
    ABSENT,
    LIVE,
    TOMBSTONE,
    TOMBSTONE_BYTES,
    decode_states,
    encode_keys,
    encode_rows,
    encode_tombstones,
)
from hps_service.tiers.rocksdb.layout import META_CF, POSITIONS_CF, drain, int_value, meta_key

#: Entries read per step by :meth:`WriteStaging.purge_tombstones`.
SCAN_CHUNK = 65_536

#: ``on_write(table, keys)``: keys of a write batch that reached the store (None when too many to list).
WriteHook = Callable[[str, "np.ndarray | None"], None]


class StagedStore(Protocol):
    """What :class:`WriteStaging` uses of the tier that builds it (:class:`RocksDBTier`): the open store, a table's
    column family and dim, its handle, the metadata's counts and the synced write of a batch."""

    @property
    def _db(self) -> Rdict: ...

    @property
    def _handles(self) -> dict[str, object]: ...

    def _table(self, table: str) -> tuple[Rdict, int]: ...

    def _meta_int(self, kind: str, table: str) -> int | None: ...

    def _write(self, batch: WriteBatch, families: Sequence[str]) -> None: ...


def checked_vectors(vectors: np.ndarray, n: int, dim: int, table: str) -> np.ndarray:
    """``vectors`` as float32 rows, checked to be ``n`` of ``dim``."""
    arr = np.asarray(vectors)
    if arr.ndim != 2 or arr.shape[0] != n or arr.shape[1] != dim:
        raise InvalidArgumentError(f"vectors for {table} must have shape ({n}, {dim}), got {arr.shape}")
    return arr.astype(np.float32, copy=False)


def stored_states(cf: Rdict, encoded_keys: list[bytes], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(codec state, stored version) of the encoded keys, read with one multi-get."""
    return decode_states(cf.get(encoded_keys), dim)


def accepts(states: np.ndarray, stored: np.ndarray, offered: np.ndarray | int) -> np.ndarray:
    """Where a put at ``offered`` may be written: absent, a row not newer, or a tombstone strictly older."""
    return np.where(
        states == LIVE, offered >= stored, np.where(states == TOMBSTONE, offered > stored, True)
    )


class WriteStaging:
    """The staging of a tier's writes into batches, their commit, and the tombstone sweep; it holds the keys staged
    until their batch is committed, then names them to ``on_write``."""

    def __init__(self, store: StagedStore, lock: threading.RLock, on_write: WriteHook | None) -> None:
        """``lock``: the tier's write lock, which the callers of the staging methods hold (the sweep takes it)."""
        self._store = store
        self._lock = lock
        self._on_write = on_write
        #: (table, keys) of each batch staged since the last commit, for ``on_write``.
        self._staged: list[tuple[str, np.ndarray]] = []

    def accepts_puts(self, table: str, keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Where a put of ``keys`` at ``versions`` would be written (see :func:`accepts`), tombstones included."""
        cf, dim = self._store._table(table)
        keys = as_keys(keys)
        if keys.size == 0:
            return np.zeros(0, dtype=bool)
        states, stored = stored_states(cf, encode_keys(keys), dim)
        return accepts(states, stored, np.broadcast_to(np.asarray(versions, dtype=np.int64), keys.shape))

    def add_counts(self, batch: WriteBatch, table: str, rows: int, tombstones: int) -> None:
        """Adjust the row and tombstone counts of ``table`` inside ``batch`` (caller holds the lock)."""
        self.stage_counts(batch, {("count", table): rows, ("tombstones", table): tombstones})

    def stage_counts(self, batch: WriteBatch, deltas: dict[tuple[str, str], int]) -> None:
        """Put the counts changed by ``deltas`` ((kind, table) -> change) into ``batch`` (caller holds the lock)."""
        meta = self._store._db.get_column_family_handle(META_CF)
        for (kind, table), delta in deltas.items():
            if delta:
                count = max(0, (self._store._meta_int(kind, table) or 0) + delta)
                batch.put(meta_key(kind, table), int_value(count), meta)

    def stage_put(
        self, batch: WriteBatch, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray,
        deltas: dict[tuple[str, str], int],
    ) -> np.ndarray:
        """Stage the rows whose version is >= the stored row's (> a tombstone's) into ``batch``; the written mask.
        Keys are unique; the caller holds the lock."""
        cf, dim = self._store._table(table)
        keys = as_keys(keys)
        n = keys.size
        vectors = checked_vectors(vectors, n, dim, table)
        offered = np.asarray(versions, dtype=np.int64)
        if offered.shape not in ((), (n,)):
            raise InvalidArgumentError(f"versions for {table} must have shape ({n},), got {offered.shape}")
        offered = np.broadcast_to(offered, (n,))
        if n == 0:
            return np.zeros(0, dtype=bool)
        encoded = encode_keys(keys)
        states, stored = stored_states(cf, encoded, dim)
        written = accepts(states, stored, offered)
        idx = np.flatnonzero(written)
        if idx.size:
            self._staged.append((table, keys if idx.size == n else keys[idx]))
            handle = self._store._handles[table]
            sel_keys = encoded if idx.size == n else encode_keys(keys[idx])
            drain(map(batch.put, sel_keys, encode_rows(vectors[idx], offered[idx]), repeat(handle)))
            replaced = states[idx]
            deltas[("count", table)] = deltas.get(("count", table), 0) + int(np.count_nonzero(replaced != LIVE))
            deltas[("tombstones", table)] = (deltas.get(("tombstones", table), 0)
                                             - int(np.count_nonzero(replaced == TOMBSTONE)))
        return written

    def stage_delete(
        self, batch: WriteBatch, table: str, keys: np.ndarray, versions: np.ndarray | None,
        deltas: dict[tuple[str, str], int],
    ) -> int:
        """Stage a delete of ``keys`` into ``batch`` (see :meth:`RocksDBTier.delete`); live rows removed. Caller holds
        the lock."""
        cf, dim = self._store._table(table)
        keys = as_keys(keys)
        tomb_versions = delete_versions(versions, keys.size)
        if keys.size == 0:
            return 0
        if tomb_versions is None:
            keys = np.unique(keys)
        else:
            keys, tomb_versions = max_version_per_key(keys, tomb_versions)
        encoded = encode_keys(keys)
        states, stored = stored_states(cf, encoded, dim)
        live = states == LIVE
        handle = self._store._handles[table]
        self._staged.append((table, keys))
        if tomb_versions is None:
            removed = int(np.count_nonzero(live))
            drain(map(batch.delete, encoded, repeat(handle)))
            tombstones = -int(np.count_nonzero(states == TOMBSTONE))
        else:
            removing = live & (stored <= tomb_versions)
            raising = (states == TOMBSTONE) & (stored < tomb_versions)
            new_tombstones = removing | (states == ABSENT)
            removed = int(np.count_nonzero(removing))
            idx = np.flatnonzero(new_tombstones | raising)
            if idx.size == 0:
                return 0
            sel_keys = encoded if idx.size == keys.size else encode_keys(keys[idx])
            drain(map(batch.put, sel_keys, encode_tombstones(tomb_versions[idx]), repeat(handle)))
            tombstones = int(np.count_nonzero(new_tombstones))
        deltas[("count", table)] = deltas.get(("count", table), 0) - removed
        deltas[("tombstones", table)] = deltas.get(("tombstones", table), 0) + tombstones
        return removed

    def commit(self, batch: WriteBatch, deltas: dict[tuple[str, str], int]) -> None:
        """Add the count changes to ``batch`` and write it (synced when sync_writes); caller holds the lock. Then
        name the keys written to ``on_write``."""
        staged, self._staged = self._staged, []
        self.stage_counts(batch, deltas)
        if not batch.is_empty():
            self._store._write(batch, [*(table for table, _ in staged), META_CF, POSITIONS_CF])
            for table, keys in staged:
                self.wrote(table, keys)

    def wrote(self, table: str, keys: np.ndarray | None) -> None:
        """Name the keys of a batch that reached the store to ``on_write`` (None: too many to list)."""
        if self._on_write is not None:
            self._on_write(table, keys)

    def purge_tombstones(self, table: str, below_version: int) -> int:
        """Remove the tombstones of ``table`` whose version is below ``below_version`` (see
        :meth:`RocksDBTier.purge_tombstones`); returns how many. Each scanned chunk's candidates are checked again
        under the write lock, so writers are not blocked through the scan."""
        cf, dim = self._store._table(table)
        handle = self._store._handles[table]
        purged = 0
        items = cf.items()
        while chunk := list(islice(items, SCAN_CHUNK)):
            keys, values = zip(*chunk)
            lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
            candidates = list(compress(keys, (lengths == TOMBSTONE_BYTES).tolist()))
            if not candidates:
                continue
            with self._lock:
                states, stored = stored_states(cf, candidates, dim)
                purge = (states == TOMBSTONE) & (stored < below_version)
                n_purge = int(np.count_nonzero(purge))
                if not n_purge:
                    continue
                batch = WriteBatch(raw_mode=True)
                drain(map(batch.delete, compress(candidates, purge.tolist()), repeat(handle)))
                self.add_counts(batch, table, rows=0, tombstones=-n_purge)
                self._store._write(batch, (table, META_CF))
                self.wrote(table, None)
            purged += n_purge
        return purged
