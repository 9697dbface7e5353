"""How the RocksDB tier turns puts and deletes into one WriteBatch: each key's stored state read with one multi-get,
rows written only where their version wins, tombstones where a delete carries one, the exact row and tombstone
counts adjusted in the same batch (mixed into :class:`RocksDBTier`)."""

from __future__ import annotations

from itertools import compress, islice, repeat
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from hps_service.tiers.rocksdb.tier import RocksDBTier

#: Entries read per step by :meth:`WriteStaging.purge_tombstones` (and the tier's ``scan_keys``).
SCAN_CHUNK = 65_536


class WriteStaging:
    """The staging of writes into batches, their commit, and the tombstone sweep of :class:`RocksDBTier`."""

    #: (table, keys) of each batch staged since the last commit, for the tier's ``on_write``.
    _staged: list[tuple[str, np.ndarray]]

    @staticmethod
    def _stored_states(cf: Rdict, encoded_keys: list[bytes], dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(codec state, stored version) of the encoded keys, read with one multi-get."""
        return decode_states(cf.get(encoded_keys), dim)

    @staticmethod
    def _accepts(states: np.ndarray, stored: np.ndarray, offered: np.ndarray | int) -> np.ndarray:
        """Where a put at ``offered`` may be written: absent, a row not newer, or a tombstone strictly older."""
        return np.where(
            states == LIVE, offered >= stored, np.where(states == TOMBSTONE, offered > stored, True)
        )

    def accepts(self: RocksDBTier, table: str, keys: np.ndarray, versions: np.ndarray) -> np.ndarray:  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        """Where a put of ``keys`` at ``versions`` would be written (see :meth:`_accepts`), tombstones included."""
        cf, dim = self._table(table)
        keys = as_keys(keys)
        if keys.size == 0:
            return np.zeros(0, dtype=bool)
        states, stored = self._stored_states(cf, encode_keys(keys), dim)
        return self._accepts(states, stored, np.broadcast_to(np.asarray(versions, dtype=np.int64), keys.shape))

    def _add_counts(self: RocksDBTier, batch: WriteBatch, table: str, rows: int, tombstones: int) -> None:  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        """Adjust the row and tombstone counts of ``table`` inside ``batch`` (caller holds the lock)."""
        self._stage_counts(batch, {("count", table): rows, ("tombstones", table): tombstones})

    def _stage_counts(self: RocksDBTier, batch: WriteBatch, deltas: dict[tuple[str, str], int]) -> None:  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        """Put the counts changed by ``deltas`` ((kind, table) -> change) into ``batch`` (caller holds the lock)."""
        meta = self._db.get_column_family_handle(META_CF)
        for (kind, table), delta in deltas.items():
            if delta:
                count = max(0, (self._meta_int(kind, table) or 0) + delta)
                batch.put(meta_key(kind, table), int_value(count), meta)

    def _stage_put(  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        self: RocksDBTier, batch: WriteBatch, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray,
        deltas: dict[tuple[str, str], int],
    ) -> np.ndarray:
        """Stage the rows whose version is >= the stored row's (> a tombstone's) into ``batch``; the written mask.
        Keys are unique; the caller holds the lock."""
        cf, dim = self._table(table)
        keys = as_keys(keys)
        n = keys.size
        vectors = self._vectors(vectors, n, dim, table)
        offered = np.asarray(versions, dtype=np.int64)
        if offered.shape not in ((), (n,)):
            raise InvalidArgumentError(f"versions for {table} must have shape ({n},), got {offered.shape}")
        offered = np.broadcast_to(offered, (n,))
        if n == 0:
            return np.zeros(0, dtype=bool)
        encoded = encode_keys(keys)
        states, stored = self._stored_states(cf, encoded, dim)
        written = self._accepts(states, stored, offered)
        idx = np.flatnonzero(written)
        if idx.size:
            self._staged.append((table, keys if idx.size == n else keys[idx]))
            handle = self._handles[table]
            sel_keys = encoded if idx.size == n else encode_keys(keys[idx])
            drain(map(batch.put, sel_keys, encode_rows(vectors[idx], offered[idx]), repeat(handle)))
            replaced = states[idx]
            deltas[("count", table)] = deltas.get(("count", table), 0) + int(np.count_nonzero(replaced != LIVE))
            deltas[("tombstones", table)] = (deltas.get(("tombstones", table), 0)
                                             - int(np.count_nonzero(replaced == TOMBSTONE)))
        return written

    def _stage_delete(  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        self: RocksDBTier, batch: WriteBatch, table: str, keys: np.ndarray, versions: np.ndarray | None,
        deltas: dict[tuple[str, str], int],
    ) -> int:
        """Stage a delete of ``keys`` into ``batch`` (see :meth:`delete`); live rows removed. Caller holds the lock."""
        cf, dim = self._table(table)
        keys = as_keys(keys)
        tomb_versions = delete_versions(versions, keys.size)
        if keys.size == 0:
            return 0
        if tomb_versions is None:
            keys = np.unique(keys)
        else:
            keys, tomb_versions = max_version_per_key(keys, tomb_versions)
        encoded = encode_keys(keys)
        states, stored = self._stored_states(cf, encoded, dim)
        live = states == LIVE
        handle = self._handles[table]
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

    def _commit(self: RocksDBTier, batch: WriteBatch, deltas: dict[tuple[str, str], int]) -> None:  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        """Add the count changes to ``batch`` and write it (synced when sync_writes); caller holds the lock. Then
        name the keys written to ``on_write``."""
        staged, self._staged = self._staged, []
        self._stage_counts(batch, deltas)
        if not batch.is_empty():
            self._write(batch, [*(table for table, _ in staged), META_CF, POSITIONS_CF])
            for table, keys in staged:
                self._wrote(table, keys)

    def _wrote(self: RocksDBTier, table: str, keys: np.ndarray | None) -> None:  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        if self._on_write is not None:
            self._on_write(table, keys)

    def purge_tombstones(self: RocksDBTier, table: str, below_version: int) -> int:  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        """Remove the tombstones of ``table`` whose version is below ``below_version``; returns how many.

        A tombstone only matters while a put older than it can still arrive (a replay of the update log), so
        ``below_version`` is the oldest version any producer or log can still deliver. Scans the whole table
        without blocking writers: each scanned chunk's candidates are checked again under the write lock.
        """
        self._check_writable(f"purge tombstones of {table}")
        cf, dim = self._table(table)
        handle = self._handles[table]
        purged = 0
        items = cf.items()
        while chunk := list(islice(items, SCAN_CHUNK)):
            keys, values = zip(*chunk)
            lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
            candidates = list(compress(keys, (lengths == TOMBSTONE_BYTES).tolist()))
            if not candidates:
                continue
            with self._lock:
                states, stored = self._stored_states(cf, candidates, dim)
                purge = (states == TOMBSTONE) & (stored < below_version)
                n_purge = int(np.count_nonzero(purge))
                if not n_purge:
                    continue
                batch = WriteBatch(raw_mode=True)
                drain(map(batch.delete, compress(candidates, purge.tolist()), repeat(handle)))
                self._add_counts(batch, table, rows=0, tombstones=-n_purge)
                self._write(batch, (table, META_CF))
                self._wrote(table, None)
            purged += n_purge
        return purged
