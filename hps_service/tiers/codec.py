"""Byte encodings of keys and versioned rows shared by the Redis and RocksDB tiers.

Keys are 8-byte big-endian signed int64 (so RocksDB's byte order is key order for keys >= 0).
A stored row is ``<version int64 little-endian><dim float32 little-endian>``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hps_service.tiers.base import Rows


def row_dtype(dim: int) -> np.dtype:
    """The record layout of one stored row."""
    return np.dtype([("version", "<i8"), ("vector", "<f4", (dim,))])


def encode_keys(keys: np.ndarray) -> list[bytes]:
    """int64 keys -> list of 8-byte big-endian bytes (one C-level pass, no Python loop)."""
    return np.ascontiguousarray(keys, dtype=">i8").view("V8").tolist()


def encode_rows(vectors: np.ndarray, versions: np.ndarray) -> list[bytes]:
    """(n, dim) float32 rows + (n,) int64 versions -> list of encoded row values."""
    n, dim = vectors.shape
    rec = np.empty(n, dtype=row_dtype(dim))
    rec["version"] = versions
    rec["vector"] = vectors
    return rec.view(f"V{rec.dtype.itemsize}").tolist()


def decode_rows(values: Sequence[bytes | None], dim: int) -> Rows:
    """A list of encoded values (None where absent) -> Rows, vectorised over the batch."""
    n = len(values)
    rows = Rows.empty(n, dim)
    if n == 0:
        return rows
    missing = values.count(None) if isinstance(values, list) else sum(v is None for v in values)
    if missing == n:
        return rows
    if missing == 0:
        present = values
        rows.found[:] = True
    else:
        arr = np.empty(n, dtype=object)
        arr[:] = values
        found = arr != None  # noqa: E711  (element-wise comparison on an object array)
        rows.found[:] = found
        present = arr[found].tolist()
    dt = row_dtype(dim)
    blob = b"".join(present)
    if len(blob) != len(present) * dt.itemsize:
        raise ValueError(f"stored rows do not have dim {dim} ({len(blob)} bytes for {len(present)} rows)")
    rec = np.frombuffer(blob, dtype=dt)
    if missing == 0:
        rows.vectors[:] = rec["vector"]
        rows.versions[:] = rec["version"]
    else:
        rows.vectors[rows.found] = rec["vector"]
        rows.versions[rows.found] = rec["version"]
    return rows
