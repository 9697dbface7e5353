"""An in-process sink with the Publisher's ``publish``/``delete``/``flush`` that keeps the newest row per key.

The trainer can publish into it instead of Kafka (no broker needed), and it answers ``lookup_many`` like the gRPC
client, so a ``Predictor`` can score from it. As on the server's tiers: versions are kept per row, an older version
never overwrites a newer one, a delete leaves a tombstone at its version that only a newer row replaces, and a key
without a row reads as the table's ``hashed_random`` default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hps_service.engine.defaults import hashed_random_rows
from hps_service.errors import InvalidArgumentError, NotFoundError
from hps_service.trainer.keyindex import KeyIndex


@dataclass
class StoredAnswer:
    """Rows of one table in the order asked (the shape of the client's ``TableAnswer``)."""

    vectors: np.ndarray


class _Table:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.index = KeyIndex(1024)
        self.rows = np.zeros((1024, dim), dtype=np.float32)
        self.versions = np.zeros(1024, dtype=np.int64)
        self.deleted = np.zeros(1024, dtype=bool)
        self.size = 0

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """Slots of distinct keys, adding the missing ones (as tombstones at version -1)."""
        slots = self.index.find(keys)
        new = slots < 0
        if new.any():
            n = int(new.sum())
            if self.size + n > self.rows.shape[0]:
                cap = max(2 * self.rows.shape[0], self.size + n)
                self.rows = np.concatenate([self.rows, np.zeros((cap - self.rows.shape[0], self.dim), np.float32)])
                self.versions = np.concatenate([self.versions, np.zeros(cap - self.versions.size, np.int64)])
                self.deleted = np.concatenate([self.deleted, np.zeros(cap - self.deleted.size, bool)])
            fresh = np.arange(self.size, self.size + n, dtype=np.int32)
            self.index.insert(keys[new], fresh)
            self.versions[fresh] = -1
            self.deleted[fresh] = True
            slots[new] = fresh
            self.size += n
        return slots


class LatestRowStore:
    """Per-table newest row and version for any int64 key."""

    def __init__(self, tables: Mapping[str, int]) -> None:
        """``tables``: table name -> dim."""
        self._tables = {name: _Table(dim) for name, dim in tables.items()}
        self.rows_published = 0
        self.rows_deleted = 0
        self.flushes = 0

    def _table(self, table: str) -> _Table:
        if table not in self._tables:
            raise NotFoundError(f"row store has no table {table!r}")
        return self._tables[table]

    @staticmethod
    def _newest(keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Index of the last occurrence of each distinct key among the highest versions given for it."""
        order = np.lexsort((np.arange(keys.size), versions, keys))
        last = np.r_[keys[order][1:] != keys[order][:-1], True]
        return order[last]

    def publish(self, table: str, keys: np.ndarray, rows: np.ndarray, version: int | np.ndarray) -> int:
        """Store ``rows`` where ``version`` is newer than what is held; returns rows written."""
        t = self._table(table)
        keys = np.asarray(keys, dtype=np.int64).ravel()
        rows = np.asarray(rows, dtype=np.float32)
        if rows.shape != (keys.size, t.dim):
            raise InvalidArgumentError(f"rows for table {table!r} must have shape {(keys.size, t.dim)}, got {rows.shape}")
        versions = np.broadcast_to(np.asarray(version, dtype=np.int64), keys.shape)
        pick = self._newest(keys, versions)
        slots = t.slots(keys[pick])
        # as the server's tiers: a live row yields to an equal or newer version, a tombstone only to a newer one
        newer = np.where(t.deleted[slots], versions[pick] > t.versions[slots], versions[pick] >= t.versions[slots])
        t.rows[slots[newer]] = rows[pick][newer]
        t.versions[slots[newer]] = versions[pick][newer]
        t.deleted[slots[newer]] = False
        written = int(newer.sum())
        self.rows_published += written
        return written

    def delete(self, table: str, keys: np.ndarray, version: int | np.ndarray) -> int:
        """Tombstone ``keys`` at ``version`` where that is newer than what is held; returns rows deleted."""
        t = self._table(table)
        keys = np.asarray(keys, dtype=np.int64).ravel()
        versions = np.broadcast_to(np.asarray(version, dtype=np.int64), keys.shape)
        pick = self._newest(keys, versions)
        slots = t.slots(keys[pick])
        newer = np.where(t.deleted[slots], versions[pick] > t.versions[slots], versions[pick] >= t.versions[slots])
        t.versions[slots[newer]] = versions[pick][newer]
        t.deleted[slots[newer]] = True
        self.rows_deleted += int(newer.sum())
        return int(newer.sum())

    def flush(self) -> None:
        """Nothing is buffered; counts the call so tests can see the trainer flushed."""
        self.flushes += 1

    def lookup(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` in the order given, (n, dim) float32; the hashed_random default where none is held."""
        t = self._table(table)
        keys = np.asarray(keys, dtype=np.int64).ravel()
        slots = t.index.find(keys)
        held = slots >= 0
        held[held] = ~t.deleted[slots[held]]
        out = np.empty((keys.size, t.dim), dtype=np.float32)
        out[held] = t.rows[slots[held]]
        out[~held] = hashed_random_rows(keys[~held], t.dim)
        return out

    def lookup_many(self, model: str, keys_by_table: Mapping[str, np.ndarray]) -> dict[str, StoredAnswer]:
        """The client's multi-table lookup (``model`` is not checked: the store holds one model)."""
        return {table: StoredAnswer(self.lookup(table, keys)) for table, keys in keys_by_table.items()}

    def versions(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Version held for each key (a tombstone's too), -1 where nothing was published."""
        t = self._table(table)
        slots = t.index.find(np.asarray(keys, dtype=np.int64).ravel())
        return np.where(slots >= 0, t.versions[np.maximum(slots, 0)], -1)

    def held(self, table: str) -> np.ndarray:
        """Keys with a live (not deleted) row, sorted."""
        t = self._table(table)
        keys, slots = t.index.items()
        return np.sort(keys[~t.deleted[slots]])
