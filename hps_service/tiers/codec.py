"""Byte encodings of keys and versioned rows shared by the Redis and RocksDB tiers.

Keys are 8-byte big-endian signed int64 (so RocksDB's byte order is key order for keys >= 0).
A stored row is ``<version int64 little-endian><dim float32 little-endian>``; a tombstone (a versioned
delete) is the 8 version bytes alone. Rows are at least 12 bytes, so the length tells the two apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import cast

import numpy as np

from hps_service.tiers.base import Rows

#: Length of a tombstone value: the version alone.
TOMBSTONE_BYTES = 8
#: States of a stored value, as :func:`decode_states` reports them.
ABSENT, LIVE, TOMBSTONE = 0, 1, 2


def row_dtype(dim: int) -> np.dtype:
    """The record layout of one stored row."""
    return np.dtype([("version", "<i8"), ("vector", "<f4", (dim,))])


def encode_keys(keys: np.ndarray) -> list[bytes]:
    """int64 keys -> list of 8-byte big-endian bytes (one C-level pass, no Python loop)."""
    encoded: list[bytes] = np.ascontiguousarray(keys, dtype=">i8").view("V8").tolist()
    return encoded


def encode_rows(vectors: np.ndarray, versions: np.ndarray) -> list[bytes]:
    """(n, dim) float32 rows + (n,) int64 versions -> list of encoded row values."""
    n, dim = vectors.shape
    rec = np.empty(n, dtype=row_dtype(dim))
    rec["version"] = versions
    rec["vector"] = vectors
    encoded: list[bytes] = rec.view(f"V{rec.dtype.itemsize}").tolist()
    return encoded


def encode_tombstones(versions: np.ndarray) -> list[bytes]:
    """(n,) int64 versions -> list of tombstone values (8 bytes little-endian each)."""
    encoded: list[bytes] = np.ascontiguousarray(versions, dtype="<i8").view("V8").tolist()
    return encoded


def _present(values: Sequence[bytes | None]) -> tuple[np.ndarray | None, list[bytes]]:
    """(mask of non-None values or None when all are present, the present values in order)."""
    n = len(values)
    missing = values.count(None) if isinstance(values, list) else sum(v is None for v in values)
    if missing == 0:  # no None among them
        return None, cast(list[bytes], values) if isinstance(values, list) else cast(list[bytes], list(values))
    arr = np.empty(n, dtype=object)
    arr[:] = values
    found = arr != None  # element-wise on an object array: where a value is present
    present: list[bytes] = arr[found].tolist()
    return found, present


def _lengths(present: list[bytes], row_bytes: int, dim: int) -> np.ndarray:
    """Byte length of each present value; raises if one is neither a row of ``dim`` nor a tombstone."""
    lengths = np.fromiter(map(len, present), dtype=np.int64, count=len(present))
    bad = (lengths != row_bytes) & (lengths != TOMBSTONE_BYTES)
    if bad.any():
        raise ValueError(
            f"stored value of {int(lengths[bad][0])} bytes is neither a dim-{dim} row nor a tombstone"
        )
    return lengths


def decode_states(values: Sequence[bytes | None], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(state, version) of each value: ABSENT / LIVE / TOMBSTONE (uint8) and the int64 version (0 if absent)."""
    n = len(values)
    states = np.zeros(n, dtype=np.uint8)
    versions = np.zeros(n, dtype=np.int64)
    if n == 0:
        return states, versions
    found, present = _present(values)
    if not present:
        return states, versions
    lengths = _lengths(present, row_dtype(dim).itemsize, dim)
    blob = np.frombuffer(b"".join(present), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    present_versions = blob[starts[:, None] + np.arange(8)].copy().view("<i8")[:, 0]
    present_states = np.where(lengths == TOMBSTONE_BYTES, TOMBSTONE, LIVE).astype(np.uint8)
    if found is None:
        states[:], versions[:] = present_states, present_versions
    else:
        states[found], versions[found] = present_states, present_versions
    return states, versions


def decode_rows(values: Sequence[bytes | None], dim: int) -> Rows:
    """A list of encoded values (None where absent) -> Rows, vectorised over the batch; tombstones are not found."""
    n = len(values)
    rows = Rows.empty(n, dim)
    if n == 0:
        return rows
    found, present = _present(values)
    if not present:
        return rows
    dt = row_dtype(dim)
    blob = b"".join(present)
    if len(blob) != len(present) * dt.itemsize:  # tombstones among them (or a corrupt value: _lengths raises)
        live = _lengths(present, dt.itemsize, dim) == dt.itemsize
        if found is None:
            found = live
        else:
            found[found] = live
        blob = b"".join(compress(present, live.tolist()))
    rec = np.frombuffer(blob, dtype=dt)
    if found is None:
        rows.found[:] = True
        rows.vectors[:] = rec["vector"]
        rows.versions[:] = rec["version"]
    else:
        rows.found[:] = found
        rows.vectors[found] = rec["vector"]
        rows.versions[found] = rec["version"]
    return rows
