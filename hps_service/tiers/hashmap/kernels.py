"""Numba kernels of the in-process hash map tier: an open-addressing index over compact row storage.

The index is an int32 array of row ids (-1 = empty), a power of two long, probed linearly from a
splitmix64 hash of the key; keys live once, in the row-aligned ``keys`` array (with ``versions`` and
``stamps`` it may be a strided view of one (rows, 3) array, so the three share a cache line). Rows are kept dense in
``[0, n_rows)``: removing a row moves the last row into its place, and deletions from the index shift
the following probe run back, so no index tombstones accumulate. A *row* tombstone (a versioned delete) is
a row whose stamp is negative (the table clock when written minus ``TOMBSTONE_BASE``): it keeps its key
and version, is never returned by a get, refuses puts at or below its version, and is evicted before live
rows, oldest first. Every kernel loops over the whole batch
inside numba and releases the GIL; callers hold the table's lock. The batch get works in passes and
prefetches rows ahead, so that the cache misses of different keys overlap.

Readers in other processes (the node's workers, colocated clients) take no lock: :func:`read_rows` is a
sequence-lock read over the same arrays (see its docstring), and writers bracket every change with
:func:`seq_begin` and :func:`seq_end` on the table's control array. Readers never write the rows' metadata;
worker reads record their accesses in a separate ``reader_stamps`` array (:func:`stamp_reads`) that eviction
takes into account and that moves with the rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hps_service.jit.atomic import acquire_fence, atomic_fetch_add, atomic_load
from hps_service.jit.hashing import mix64
from hps_service.jit.prefetch import prefetch as _prefetch

EMPTY = np.int32(-1)
#: Subtracted from the table clock to stamp a tombstone: negative, and older tombstones sort (and evict) first.
TOMBSTONE_BASE = np.int64(1 << 62)
#: Eviction rebuilds the index, instead of removing each victim's slot, from one victim per this many rows up
#: (removing a slot costs about 1 us of scattered reads, rebuilding about 35 ns a remaining row).
MANY_VICTIMS_PER_ROW = 32
#: How many keys ahead the row copy loop asks the CPU to fetch rows, so their cache misses overlap.
PREFETCH_AHEAD = 8
#: Indices into a table's control array (int64): the sequence on its own 64-byte line (the writer bumps it for
#: every change; readers only load it), then what readers need to map the index, and the table clock.
CTRL_SEQ, CTRL_INDEX_GEN, CTRL_INDEX_LEN, CTRL_CLOCK = 0, 8, 9, 16
CTRL_LEN = 24
#: :func:`read_rows` results other than a hit count.
READ_OVERLAPPED = -1
READ_REMAP = -2


@njit(cache=True, nogil=True, inline="always")
def _prefetch_row(rows: np.ndarray, meta: np.ndarray, r: np.int64) -> None:
    """Prefetch every cache line of row ``r`` of ``rows`` and its entry of the 1-D ``meta`` view."""
    dim = rows.shape[1]
    for d in range(0, dim, 16):
        _prefetch(rows, r, d)
    _prefetch(rows, r, dim - 1)
    _prefetch(meta, r, 0)


@njit(cache=True, nogil=True, inline="always")
def _home(key: np.int64, mask: np.int64) -> np.int64:
    """The first index slot to probe for ``key`` (splitmix64 finaliser, masked to the table size)."""
    return np.int64(mix64(np.uint64(key)) & np.uint64(mask))


@njit(cache=True, nogil=True, inline="always")
def _probe(index: np.ndarray, keys: np.ndarray, key: np.int64, mask: np.int64) -> tuple[np.int64, bool]:
    """The slot holding ``key`` and True, or the empty slot where it would go and False."""
    pos = _home(key, mask)
    while True:
        row = index[pos]
        if row < 0:
            return pos, False
        if keys[row] == key:
            return pos, True
        pos = (pos + 1) & mask


@njit(cache=True, nogil=True)
def _remove_slot(index: np.ndarray, keys: np.ndarray, pos: np.int64, mask: np.int64) -> None:
    """Empty index slot ``pos`` and shift back later entries of its probe run (backward-shift deletion)."""
    hole = pos
    j = pos
    while True:
        j = (j + 1) & mask
        row = index[j]
        if row < 0:
            break
        home = _home(keys[row], mask)
        if hole <= j:
            stays = hole < home <= j
        else:
            stays = home > hole or home <= j
        if stays:
            continue
        index[hole] = row
        hole = j
    index[hole] = EMPTY


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
        pos, _ = _probe(index, keys, keys[last], mask)
        index[pos] = np.int32(row)
        keys[row] = keys[last]
        rows[row, :] = rows[last, :]
        versions[row] = versions[last]
        stamps[row] = stamps[last]
        reader_stamps[row] = reader_stamps[last]
    return last


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
        homes[r] = _home(keys[r], mask)
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
def get_rows(
    index: np.ndarray,
    keys: np.ndarray,
    rows: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    query: np.ndarray,
    out_vectors: np.ndarray,
    out_versions: np.ndarray,
    found: np.ndarray,
    clock: np.int64,
    lfu: bool,
) -> np.int64:
    """Copy the rows of ``query`` into the outputs and stamp every hit; returns the number of hits.

    Tombstones count as misses and keep their stamp.

    Works in passes (first index slots, then key checks, then row copies) so that the loads of one
    pass are independent of each other and their cache misses overlap.
    """
    mask = np.int64(index.size - 1)
    n = query.size
    dim = rows.shape[1]
    row_ids = np.empty(n, dtype=np.int64)
    for i in range(n):
        row_ids[i] = index[_home(query[i], mask)]
    for i in range(n):
        r = row_ids[i]
        if r >= 0 and keys[r] != query[i]:
            pos, ok = _probe(index, keys, query[i], mask)
            row_ids[i] = index[pos] if ok else -1
    for i in range(min(PREFETCH_AHEAD, n)):
        if row_ids[i] >= 0:
            _prefetch_row(rows, versions, row_ids[i])
    hits = 0
    for i in range(n):
        ahead = i + PREFETCH_AHEAD
        if ahead < n and row_ids[ahead] >= 0:
            _prefetch_row(rows, versions, row_ids[ahead])
        r = row_ids[i]
        if r < 0 or stamps[r] < 0:  # absent, or a tombstone (the key was deleted)
            row_ids[i] = -1
            found[i] = False
            continue
        src = rows[r]
        dst = out_vectors[i]
        for d in range(dim):
            dst[d] = src[d]
        out_versions[i] = versions[r]
        found[i] = True
        hits += 1
    if lfu:
        for i in range(n):
            if row_ids[i] >= 0:
                stamps[row_ids[i]] += 1
    else:
        for i in range(n):
            if row_ids[i] >= 0:
                stamps[row_ids[i]] = clock
    return hits


@njit(cache=True, nogil=True)
def locate_rows(index: np.ndarray, keys: np.ndarray, query: np.ndarray, out_rows: np.ndarray) -> np.int64:
    """Write the row id of each ``query`` key (-1 if absent) into ``out_rows``; returns how many are absent."""
    mask = np.int64(index.size - 1)
    missing = 0
    for i in range(query.size):
        pos, ok = _probe(index, keys, query[i], mask)
        if ok:
            out_rows[i] = index[pos]
        else:
            out_rows[i] = -1
            missing += 1
    return missing


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
) -> tuple[np.int64, np.int64]:
    """Upsert rows in batch order; returns (new row count, tombstones replaced by rows).

    A stored row with a newer version is kept; a tombstone is kept unless the offered version is newer than
    it. New keys are appended while fewer than ``row_limit`` rows are held; the rest are not written.
    """
    mask = np.int64(index.size - 1)
    dim = rows.shape[1]
    n = n_rows
    revived = 0
    for i in range(query.size):
        key = query[i]
        pos, ok = _probe(index, keys, key, mask)
        if ok:
            r = np.int64(index[pos])
            if stamps[r] < 0:
                if offered_versions[i] <= versions[r]:
                    written[i] = False
                    continue
                stamps[r] = 1 if lfu else clock
                revived += 1
            elif offered_versions[i] < versions[r]:
                written[i] = False
                continue
            elif not lfu:
                stamps[r] = clock
        else:
            if n >= row_limit:
                written[i] = False
                continue
            r = n
            n += 1
            index[pos] = np.int32(r)
            keys[r] = key
            stamps[r] = 1 if lfu else clock
            reader_stamps[r] = 0
        for d in range(dim):
            rows[r, d] = vectors[i, d]
        versions[r] = offered_versions[i]
        written[i] = True
    return n, revived


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
) -> tuple[np.int64, np.int64, np.int64]:
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
        pos, ok = _probe(index, keys, query[i], mask)
        if ok:
            r = np.int64(index[pos])
            if stamps[r] < 0:
                if version > versions[r]:
                    versions[r] = version
                    stamps[r] = clock - TOMBSTONE_BASE
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
        stamps[r] = clock - TOMBSTONE_BASE
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
) -> tuple[np.int64, np.int64, np.int64]:
    """Remove the ``query`` keys, rows and tombstones alike; returns (new row count, rows, tombstones removed)."""
    mask = np.int64(index.size - 1)
    n = n_rows
    removed = 0
    tombstones = 0
    for i in range(query.size):
        pos, ok = _probe(index, keys, query[i], mask)
        if not ok:
            continue
        r = np.int64(index[pos])
        if stamps[r] < 0:
            tombstones += 1
        else:
            removed += 1
        _remove_slot(index, keys, pos, mask)
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
                rows[r, :] = rows[last, :]
                versions[r] = versions[last]
                stamps[r] = stamps[last]
                reader_stamps[r] = reader_stamps[last]
            n = last
        rebuild_index(index, keys, n)
        return n
    for i in range(victims_descending.size):
        r = np.int64(victims_descending[i])
        pos, _ = _probe(index, keys, keys[r], mask)
        _remove_slot(index, keys, pos, mask)
        n = _drop_row(index, keys, rows, versions, stamps, reader_stamps, r, n, mask)
    return n


@njit(cache=True, nogil=True)
def seq_begin(ctrl: np.ndarray) -> None:
    """Writer: make the sequence odd before changing the table. A sequentially consistent read-modify-write is
    a full barrier (x86-64: ``lock xadd``; aarch64: ``ldaxr``/``stlxr``): no store of the change can become
    visible before the odd value, and the compiler cannot move the change's stores above it."""
    atomic_fetch_add(ctrl, CTRL_SEQ, 1)


@njit(cache=True, nogil=True)
def seq_end(ctrl: np.ndarray) -> None:
    """Writer: make the sequence even again after the change (a full barrier, as in :func:`seq_begin`: every
    store of the change is visible before the even value)."""
    atomic_fetch_add(ctrl, CTRL_SEQ, 1)


@njit(cache=True, nogil=True)
def tick(ctrl: np.ndarray) -> np.int64:
    """Advance the table clock by one (one tick per batch, from any process) and return the new value."""
    return atomic_fetch_add(ctrl, CTRL_CLOCK, 1) + 1


@njit(cache=True, nogil=True)
def read_rows(
    ctrl: np.ndarray,
    index: np.ndarray,
    index_gen: np.int64,
    keys: np.ndarray,
    rows: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    query: np.ndarray,
    out_vectors: np.ndarray,
    out_versions: np.ndarray,
    found: np.ndarray,
    row_ids: np.ndarray,
) -> np.int64:
    """A lock-free read of ``query`` by a process that is not the writer; returns the number of hits, or
    ``READ_OVERLAPPED`` (a write overlapped: run again) or ``READ_REMAP`` (the index was replaced: map
    generation ``ctrl[CTRL_INDEX_GEN]`` and run again). Writes only its outputs; ``row_ids[i]`` is the row of
    each hit (-1 otherwise), for :func:`stamp_reads`.

    Sequence lock, as in Boehm's "Can seqlocks get along with programming language memory models?" (2012):
    the sequence is loaded with acquire ordering first (no read of the table moves above it), the table is read
    with plain loads, an acquire fence follows (no read of the table moves below the re-check) and the sequence
    is loaded again; equal and even means no writer ran in between, since writers bump it with full barriers
    around every change (:func:`seq_begin`). On x86-64 the acquire load and fence compile to plain loads and a
    compiler barrier (loads are not reordered with loads there); on aarch64 to ``ldar`` and ``dmb ishld``.
    A read that overlapped a write may have seen anything, so every row id and probe taken from the index is
    bounds-checked before use and the probe stops after one lap: a torn read returns READ_OVERLAPPED, never
    reads outside the arrays and never loops forever.
    """
    seq = atomic_load(ctrl, CTRL_SEQ)
    if seq & 1:
        return READ_OVERLAPPED
    if atomic_load(ctrl, CTRL_INDEX_GEN) != index_gen:
        return READ_REMAP
    size = index.size
    mask = np.int64(size - 1)
    capacity = rows.shape[0]
    dim = rows.shape[1]
    n = query.size
    torn = False
    for i in range(n):
        key = query[i]
        pos = _home(key, mask)
        r = np.int64(-1)
        for _ in range(size):
            cand = np.int64(index[pos])
            if cand < 0:
                break
            if cand >= capacity:
                torn = True
                break
            if keys[cand] == key:
                r = cand
                break
            pos = (pos + 1) & mask
        if torn:
            break
        row_ids[i] = r
    if torn:
        return READ_OVERLAPPED
    for i in range(min(PREFETCH_AHEAD, n)):
        if row_ids[i] >= 0:
            _prefetch_row(rows, versions, row_ids[i])
    hits = 0
    for i in range(n):
        ahead = i + PREFETCH_AHEAD
        if ahead < n and row_ids[ahead] >= 0:
            _prefetch_row(rows, versions, row_ids[ahead])
        r = row_ids[i]
        if r < 0 or stamps[r] < 0:
            row_ids[i] = -1
            found[i] = False
            continue
        for d in range(dim):
            out_vectors[i, d] = rows[r, d]
        out_versions[i] = versions[r]
        found[i] = True
        hits += 1
    acquire_fence()
    if atomic_load(ctrl, CTRL_SEQ) != seq:
        return READ_OVERLAPPED
    return hits


@njit(cache=True, nogil=True)
def stamp_reads(reader_stamps: np.ndarray, row_ids: np.ndarray, clock: np.int64, lfu: bool) -> None:
    """Record a validated read's hits for eviction: LRU, the clock (written only where it differs, so hot rows
    do not bounce their cache line between readers); LFU, one more access (racy across processes: a lost count
    only blurs the order). A row moved meanwhile gets a stamp it did not earn, which only affects eviction order."""
    for i in range(row_ids.size):
        r = row_ids[i]
        if r < 0 or r >= reader_stamps.size:
            continue
        if lfu:
            reader_stamps[r] += 1
        elif reader_stamps[r] != clock:
            reader_stamps[r] = clock
