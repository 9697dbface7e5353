"""An in-process sink with the Publisher's ``publish``/``flush`` interface that keeps the newest row per key.

The trainer can publish into it instead of Kafka (no broker needed), and an inference path can look rows up
from it; a key never published reads as zeros. Versions are kept per row and an older version never overwrites
a newer one, as on the server.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hps_service.errors import InvalidArgumentError, NotFoundError


class LatestRowStore:
    """Dense per-table arrays of the newest published row and its version, for int64 keys in [0, cardinality)."""

    def __init__(self, tables: Mapping[str, tuple[int, int]]) -> None:
        """``tables``: table name -> (cardinality, dim)."""
        self._rows = {name: np.zeros((card, dim), dtype=np.float32) for name, (card, dim) in tables.items()}
        self._versions = {name: np.full(card, -1, dtype=np.int64) for name, (card, _) in tables.items()}
        self.rows_published = 0
        self.flushes = 0

    def _table(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        if table not in self._rows:
            raise NotFoundError(f"row store has no table {table!r}")
        return self._rows[table], self._versions[table]

    def _keys(self, table: str, keys: np.ndarray) -> np.ndarray:
        rows, _ = self._table(table)
        keys = np.asarray(keys, dtype=np.int64).ravel()
        if keys.size and (keys.min() < 0 or keys.max() >= rows.shape[0]):
            raise InvalidArgumentError(f"keys of table {table!r} must be in [0, {rows.shape[0]})")
        return keys

    def publish(self, table: str, keys: np.ndarray, rows: np.ndarray, version: int | np.ndarray) -> int:
        """Store ``rows`` for ``keys`` where ``version`` is not older than what is held; returns rows written."""
        keys = self._keys(table, keys)
        table_rows, table_versions = self._table(table)
        rows = np.asarray(rows, dtype=np.float32)
        if rows.shape != (keys.size, table_rows.shape[1]):
            raise InvalidArgumentError(
                f"rows for table {table!r} must have shape {(keys.size, table_rows.shape[1])}, got {rows.shape}"
            )
        versions = np.broadcast_to(np.asarray(version, dtype=np.int64), keys.shape)
        newer = versions >= table_versions[keys]
        table_rows[keys[newer]] = rows[newer]
        table_versions[keys[newer]] = versions[newer]
        written = int(newer.sum())
        self.rows_published += written
        return written

    def flush(self) -> None:
        """Nothing is buffered; counts the call so tests can see the trainer flushed."""
        self.flushes += 1

    def lookup(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` in the order given, (n, dim) float32; zeros where nothing was published."""
        keys = self._keys(table, keys)
        return self._table(table)[0][keys]

    def versions(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Version held for each key, -1 where nothing was published."""
        keys = self._keys(table, keys)
        return self._table(table)[1][keys]
