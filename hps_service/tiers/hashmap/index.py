"""The index of the hash map tier: an int32 array of row ids (``EMPTY`` = -1), a power of two long, probed linearly
from the key's :func:`hps_service.jit.hashing.home_slot`; the keys live once, in the row-aligned ``keys`` array.

Kernels that find, place and remove index slots (the row kernels are in ``rows``). Removing a slot shifts
the rest of its probe run back, so no index tombstones accumulate. Callers hold the table's lock.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hps_service.jit.hashing import home_slot, stays_in_run
from hps_service.jit.prefetch import prefetch as _prefetch

EMPTY = np.int32(-1)
#: How many keys ahead the kernels' loops ask the CPU to fetch (index slots, rows), so their cache misses overlap.
PREFETCH_AHEAD = 8


@njit(cache=True, nogil=True, inline="always")
def probe(index: np.ndarray, keys: np.ndarray, key: np.int64, mask: np.int64) -> tuple[np.int64, bool]:
    """The slot holding ``key`` and True, or the empty slot where it would go and False."""
    pos = home_slot(key, mask)
    while True:
        row = index[pos]
        if row < 0:
            return pos, False
        if keys[row] == key:
            return pos, True
        pos = (pos + 1) & mask


@njit(cache=True, nogil=True)
def remove_slot(index: np.ndarray, keys: np.ndarray, pos: np.int64, mask: np.int64) -> None:
    """Empty index slot ``pos`` and shift back later entries of its probe run (backward-shift deletion)."""
    hole = pos
    j = pos
    while True:
        j = (j + 1) & mask
        row = index[j]
        if row < 0:
            break
        if stays_in_run(hole, home_slot(keys[row], mask), j):
            continue
        index[hole] = row
        hole = j
    index[hole] = EMPTY


@njit(cache=True, nogil=True)
def rebuild_index(index: np.ndarray, keys: np.ndarray, n_rows: np.int64) -> None:
    """Fill a fresh ``index`` with rows ``[0, n_rows)`` (after the index grew).

    The rows' keys are distinct, so each takes the first empty slot from its home without comparing keys (no read
    of the rows' metadata), and the home slots are prefetched ahead: it runs while the table's lock is held.
    """
    mask = np.int64(index.size - 1)
    index[:] = EMPTY
    homes = np.empty(n_rows, np.int64)
    for r in range(n_rows):
        homes[r] = home_slot(keys[r], mask)
    for j in range(n_rows + PREFETCH_AHEAD):
        if j < n_rows:
            _prefetch(index, homes[j], 0)
        r = j - PREFETCH_AHEAD
        if r < 0:
            continue
        pos = homes[r]
        while index[pos] != EMPTY:
            pos = (pos + 1) & mask
        index[pos] = np.int32(r)


@njit(cache=True, nogil=True)
def locate_rows(index: np.ndarray, keys: np.ndarray, query: np.ndarray, out_rows: np.ndarray) -> int:
    """Write the row id of each ``query`` key (-1 if absent) into ``out_rows``; returns how many are absent."""
    mask = np.int64(index.size - 1)
    missing = 0
    for i in range(query.size):
        pos, ok = probe(index, keys, query[i], mask)
        if ok:
            out_rows[i] = index[pos]
        else:
            out_rows[i] = -1
            missing += 1
    return missing
