"""Row storage of the hash map tier, kept dense in ``[0, n_rows)``: the owner's batch get, put, delete and eviction.

Keys live once, in the row-aligned ``keys`` array (with ``versions`` and the int32 ``stamps`` it may be a strided
view of one (rows, 3) int64 array, so they share a cache line); the index (:mod:`.index`) maps keys to row ids.
Removing a row moves the last row into its place. A *row* tombstone (a versioned delete) is a row whose stamp is
negative (:func:`.stamps.tombstone`): it keeps its key and version, is never returned by a get, refuses puts at or
below its version, and is evicted before live rows, oldest first. Every kernel loops over
the whole batch inside numba and releases the GIL; callers hold the table's lock. The batch get works in passes and
prefetches rows ahead, so that the cache misses of different keys overlap. Worker reads record their accesses in
``reader_stamps``, the other int32 half of the stamp word (see :mod:`.seqlock`), which eviction takes into account
and which moves with the rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hps_service.jit.hashing import home_slot
from hps_service.jit.prefetch import prefetch as _prefetch
from hps_service.jit.rowcopy import copy_row
from hps_service.tiers.hashmap.index import PREFETCH_AHEAD, probe, rebuild_index, remove_slot
from hps_service.tiers.hashmap.stamps import counted, live, tombstone

#: Eviction rebuilds the index, instead of removing each victim's slot, from one victim per this many rows up
#: (removing a slot costs about 1 us of scattered reads, rebuilding about 35 ns a remaining row).
MANY_VICTIMS_PER_ROW = 32


@njit(cache=True, nogil=True, inline="always")
def prefetch_row(rows: np.ndarray, meta: np.ndarray, r: np.int64) -> None:
    """Prefetch every cache line of row ``r`` of ``rows`` and its entry of the 1-D ``meta`` view."""
    dim = rows.shape[1]
    for d in range(0, dim, 16):
        _prefetch(rows, r, d)
    _prefetch(rows, r, dim - 1)
    _prefetch(meta, r, 0)


@njit(cache=True, nogil=True)
def _drop_row(
    index: np.ndarray,
    keys: np.ndarray,
    rows: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    reader_stamps: np.ndarray,
    row: np.int64,
    n_rows: np.int64,
    mask: np.int64,
) -> np.int64:
    """Remove ``row`` (already out of the index) by moving the last row into it; returns the new row count."""
    last = n_rows - 1
    if row != last:
        pos, _ = probe(index, keys, keys[last], mask)
        index[pos] = np.int32(row)
        keys[row] = keys[last]
        copy_row(rows, row, rows, last)
        versions[row] = versions[last]
        stamps[row] = stamps[last]
        reader_stamps[row] = reader_stamps[last]
    return last


@njit(cache=True, nogil=True)
def get_rows_at(
    index: np.ndarray,
    keys: np.ndarray,
    rows: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    query: np.ndarray,
    positions: np.ndarray,
    out_vectors: np.ndarray,
    out_versions: np.ndarray,
    found: np.ndarray,
    clock: np.int64,
    lfu: bool,
) -> int:
    """Copy the row of each key ``query[positions[j]]`` into ``out_vectors[positions[j]]`` (its version into
    ``out_versions[j]``) and stamp every hit; returns the number of hits.

    Tombstones count as misses and keep their stamp.

    Works in passes (first index slots, then key checks, then row copies) so that the loads of one
    pass are independent of each other and their cache misses overlap.
    """
    mask = np.int64(index.size - 1)
    n = positions.size
    row_ids = np.empty(n, dtype=np.int64)
    for j in range(n):
        row_ids[j] = index[home_slot(query[positions[j]], mask)]
    for j in range(n):
        r = row_ids[j]
        key = query[positions[j]]
        if r >= 0 and keys[r] != key:
            pos, ok = probe(index, keys, key, mask)
            row_ids[j] = index[pos] if ok else -1
    for j in range(min(PREFETCH_AHEAD, n)):
        if row_ids[j] >= 0:
            prefetch_row(rows, versions, row_ids[j])
    hits = 0
    for j in range(n):
        ahead = j + PREFETCH_AHEAD
        if ahead < n and row_ids[ahead] >= 0:
            prefetch_row(rows, versions, row_ids[ahead])
        r = row_ids[j]
        if r < 0 or stamps[r] < 0:  # absent, or a tombstone (the key was deleted)
            row_ids[j] = -1
            found[j] = False
            continue
        copy_row(out_vectors, positions[j], rows, r)
        out_versions[j] = versions[r]
        found[j] = True
        hits += 1
    if lfu:
        for j in range(n):
            if row_ids[j] >= 0:
                stamps[row_ids[j]] = counted(stamps[row_ids[j]])
    else:
        for j in range(n):
            if row_ids[j] >= 0:
                stamps[row_ids[j]] = live(clock)
    return hits


@njit(cache=True, nogil=True)
def put_rows(
    index: np.ndarray,
    keys: np.ndarray,
    rows: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    reader_stamps: np.ndarray,
    n_rows: np.int64,
    row_limit: np.int64,
    query: np.ndarray,
    vectors: np.ndarray,
    offered_versions: np.ndarray,
    written: np.ndarray,
    clock: np.int64,
    lfu: bool,
) -> tuple[np.int64, int, int]:
    """Upsert rows in batch order; returns (new row count, tombstones replaced by rows, new keys refused for room).

    A stored row with a newer version is kept; a tombstone is kept unless the offered version is newer than
    it. New keys are appended while fewer than ``row_limit`` rows are held; the rest are not written.
    """
    mask = np.int64(index.size - 1)
    dim = rows.shape[1]
    n = n_rows
    revived = 0
    full = 0
    for i in range(query.size):
        key = query[i]
        pos, ok = probe(index, keys, key, mask)
        if ok:
            r = np.int64(index[pos])
            if stamps[r] < 0:
                if offered_versions[i] <= versions[r]:
                    written[i] = False
                    continue
                stamps[r] = np.int32(1) if lfu else live(clock)
                revived += 1
            elif offered_versions[i] < versions[r]:
                written[i] = False
                continue
            elif not lfu:
                stamps[r] = live(clock)
        else:
            if n >= row_limit:
                written[i] = False
                full += 1
                continue
            r = n
            n += 1
            index[pos] = np.int32(r)
            keys[r] = key
            stamps[r] = np.int32(1) if lfu else live(clock)
            reader_stamps[r] = 0
        for d in range(dim):
            rows[r, d] = vectors[i, d]
        versions[r] = offered_versions[i]
        written[i] = True
    return n, revived, full


@njit(cache=True, nogil=True)
def tombstone_keys(
    index: np.ndarray,
    keys: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    reader_stamps: np.ndarray,
    n_rows: np.int64,
    row_limit: np.int64,
    query: np.ndarray,
    delete_versions: np.ndarray,
    clock: np.int64,
) -> tuple[np.int64, int, int]:
    """Versioned delete: turn rows at or below each delete's version into tombstones at that version.

    A newer row is kept; an older tombstone is raised to the delete's version; an absent key gets a new
    tombstone row while fewer than ``row_limit`` rows are held. Returns (new row count, live rows removed,
    tombstones added).
    """
    mask = np.int64(index.size - 1)
    n = n_rows
    removed = 0
    added = 0
    for i in range(query.size):
        version = delete_versions[i]
        pos, ok = probe(index, keys, query[i], mask)
        if ok:
            r = np.int64(index[pos])
            if stamps[r] < 0:
                if version > versions[r]:
                    versions[r] = version
                    stamps[r] = tombstone(clock)
                continue
            if versions[r] > version:
                continue
            removed += 1
            added += 1
        else:
            if n >= row_limit:
                continue
            r = n
            n += 1
            index[pos] = np.int32(r)
            keys[r] = query[i]
            reader_stamps[r] = 0
            added += 1
        versions[r] = version
        stamps[r] = tombstone(clock)
    return n, removed, added


@njit(cache=True, nogil=True)
def delete_keys(
    index: np.ndarray,
    keys: np.ndarray,
    rows: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    reader_stamps: np.ndarray,
    n_rows: np.int64,
    query: np.ndarray,
) -> tuple[np.int64, int, int]:
    """Remove the ``query`` keys, rows and tombstones alike; returns (new row count, rows, tombstones removed)."""
    mask = np.int64(index.size - 1)
    n = n_rows
    removed = 0
    tombstones = 0
    for i in range(query.size):
        pos, ok = probe(index, keys, query[i], mask)
        if not ok:
            continue
        r = np.int64(index[pos])
        if stamps[r] < 0:
            tombstones += 1
        else:
            removed += 1
        remove_slot(index, keys, pos, mask)
        n = _drop_row(index, keys, rows, versions, stamps, reader_stamps, r, n, mask)
    return n, removed, tombstones


@njit(cache=True, nogil=True)
def evict_rows(
    index: np.ndarray,
    keys: np.ndarray,
    rows: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    reader_stamps: np.ndarray,
    n_rows: np.int64,
    victims_descending: np.ndarray,
) -> np.int64:
    """Remove the distinct row ids ``victims_descending`` (sorted high to low); returns the new row count.

    Going from the highest id down, the last row moved into a hole is never a victim still to remove. When many
    rows go (the usual 10% eviction), the holes are filled first and the index rebuilt once, instead of taking
    each victim out of the index and re-pointing each moved row (100K of 1M rows: 104 ms -> about half).
    """
    mask = np.int64(index.size - 1)
    n = n_rows
    if victims_descending.size * MANY_VICTIMS_PER_ROW >= n_rows:
        for i in range(victims_descending.size):
            r = np.int64(victims_descending[i])
            last = n - 1
            if r != last:
                keys[r] = keys[last]
                copy_row(rows, r, rows, last)
                versions[r] = versions[last]
                stamps[r] = stamps[last]
                reader_stamps[r] = reader_stamps[last]
            n = last
        rebuild_index(index, keys, n)
        return n
    for i in range(victims_descending.size):
        r = np.int64(victims_descending[i])
        pos, _ = probe(index, keys, keys[r], mask)
        remove_slot(index, keys, pos, mask)
        n = _drop_row(index, keys, rows, versions, stamps, reader_stamps, r, n, mask)
    return n
