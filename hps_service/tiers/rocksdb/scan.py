"""The RocksDB tier's ordered scan of a table's stored entries, rows and tombstones alike (mixed into
:class:`RocksDBTier`): what a format conversion copies, a stretch at a time."""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from hps_service.tiers.base import StoredEntries
from hps_service.tiers.codec import TOMBSTONE, decode_rows, decode_states, encode_keys

if TYPE_CHECKING:
    from hps_service.tiers.rocksdb.tier import RocksDBTier


class EntryScan:
    """:meth:`scan` of :class:`RocksDBTier`."""

    def scan(self: RocksDBTier, table: str, after: int | None, limit: int) -> StoredEntries:  # type: ignore[misc]  # a mixin of RocksDBTier: self is the tier
        """Up to ``limit`` entries that follow key ``after`` in byte order (unsigned key order), one iterator read."""
        cf, dim = self._table(table)
        start = None if after is None else encode_keys(np.array([after], dtype=np.int64))[0]
        chunk = list(islice(cf.items(from_key=start), limit + (start is not None)))
        if start is not None and chunk and chunk[0][0] == start:
            chunk = chunk[1:]
        chunk = chunk[:limit]
        if not chunk:
            return StoredEntries(np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, np.int64),
                                 np.zeros((0, dim), np.float32))
        raw_keys, values = zip(*chunk)
        keys = np.frombuffer(b"".join(raw_keys), dtype=">i8").astype(np.int64)
        states, versions = decode_states(values, dim)
        rows = decode_rows(values, dim)
        return StoredEntries(keys, states != TOMBSTONE, versions, rows.vectors)
