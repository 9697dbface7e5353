"""Access stamps of the hash map tier's rows, four bytes each: 31 bits of the table clock, with the sign for tombstones.

A row's owner stamp and its readers' stamp are int32 halves of the row's third metadata word (beside key and
version, one cache line). LRU stamps hold the clock's low 31 bits and are read back by their age at the table
clock (:func:`decode`, :mod:`hps_service.jit.ticks`; a tick is one batch). LFU stamps are access counts that
saturate. A tombstone's stamp is ``-1 - (clock & MASK)``: negative whatever the clock, so a tombstone is never
read as a row.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hps_service.jit.ticks import MASK, signed_age

#: Subtracted from a decoded tombstone's clock: negative, and older tombstones sort (and evict) first.
TOMBSTONE_BASE = np.int64(1 << 62)


@njit(cache=True, nogil=True, inline="always")
def live(clock: np.int64) -> np.int32:
    """The LRU stamp of a row accessed at ``clock``."""
    return np.int32(clock & MASK)


@njit(cache=True, nogil=True, inline="always")
def tombstone(clock: np.int64) -> np.int32:
    """The stamp of a tombstone written at ``clock`` (negative)."""
    return np.int32(np.int64(-1) - (clock & MASK))


@njit(cache=True, nogil=True, inline="always")
def counted(stamp: np.int32) -> np.int32:
    """An LFU stamp one access later (saturating)."""
    return np.int32(stamp + 1) if stamp < MASK else stamp


def stamp_halves(meta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The owner's and the readers' int32 stamps of a table's (rows, 3) int64 metadata (key, version, stamps)."""
    halves = meta.view(np.int32)
    return halves[:, 4], halves[:, 5]


def decode(stamps: np.ndarray, reader: np.ndarray, now: int, lfu: bool) -> np.ndarray:
    """Eviction order (int64, lower goes first) of rows with owner ``stamps`` and readers' stamps ``reader`` at
    table clock ``now``: the later of the two accesses (LFU: the larger count); tombstones below every row, oldest
    first. A reader stamp of 0 is no access."""
    s = stamps.astype(np.int64)
    r = reader.astype(np.int64)
    now64 = np.int64(now)
    dead = s < 0
    if lfu:
        out = np.maximum(s, r)
    else:
        out = now64 - signed_age(now64, s)
        out = np.maximum(out, np.where(r != 0, now64 - signed_age(now64, r), 0))
        np.maximum(out, 0, out=out)
    if dead.any():
        t = -1 - s[dead]
        out[dead] = now64 - signed_age(now64, t) - TOMBSTONE_BASE
    return out
