"""The RocksDB tier's ordered scans of a table: its stored entries, rows and tombstones alike (what a format
conversion copies, a stretch at a time), and the keys of its first live rows."""

from __future__ import annotations

from itertools import islice

import numpy as np
from rocksdict import Rdict

from hps_service.tiers.base import StoredEntries
from hps_service.tiers.codec import TOMBSTONE, TOMBSTONE_BYTES, decode_rows, decode_states, encode_keys


def scan_entries(cf: Rdict, dim: int, after: int | None, limit: int) -> StoredEntries:
    """Up to ``limit`` entries of the column family ``cf`` (rows of ``dim``) that follow key ``after`` in byte order
    (unsigned key order), one iterator read."""
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


def live_keys(cf: Rdict, limit: int, tombstones: bool) -> np.ndarray:
    """The first ``limit`` keys of live rows of ``cf`` in store order (unsigned key order); ``tombstones``: whether
    it holds any to skip (else the keys are read without their values)."""
    if not tombstones:
        raw = b"".join(islice(cf.keys(), limit))
        return np.frombuffer(raw, dtype=">i8").astype(np.int64)
    found: list[np.ndarray] = []
    need = limit
    items = cf.items()
    while need > 0 and (chunk := list(islice(items, max(need, 1024)))):
        keys, values = zip(*chunk)
        live = np.fromiter(map(len, values), dtype=np.int64, count=len(values)) != TOMBSTONE_BYTES
        got = np.frombuffer(b"".join(keys), dtype=">i8")[live][:need].astype(np.int64)
        found.append(got)
        need -= got.size
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
