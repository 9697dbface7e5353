"""The hash map tier's sequence lock, between its one writer and lock-free readers in other processes (the node's
workers, colocated clients), over the table's control array (sequence, index generation and length, clock).

Writers bracket every change with :func:`seq_begin` and :func:`seq_end`; :func:`read_rows_at` is the sequence-lock read
over the index and rows (see its docstring). Readers never write the rows' metadata: they record their accesses in
``reader_stamps``, their own int32 half of each row's stamp word (:func:`stamp_reads`), which eviction takes
into account.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hps_service.jit.atomic import acquire_fence, atomic_fetch_add, atomic_load
from hps_service.jit.hashing import home_slot
from hps_service.jit.rowcopy import copy_row
from hps_service.tiers.hashmap.index import PREFETCH_AHEAD
from hps_service.tiers.hashmap.rows import prefetch_row
from hps_service.tiers.hashmap.stamps import counted, live

#: Indices into a table's control array (int64): the sequence on its own 64-byte line (the writer bumps it for
#: every change; readers only load it), then what readers need to map the index and whether the table is complete
#: (:mod:`.complete`), and the table clock.
CTRL_SEQ, CTRL_INDEX_GEN, CTRL_INDEX_LEN, CTRL_COMPLETE, CTRL_CLOCK = 0, 8, 9, 10, 16
CTRL_LEN = 24
#: :func:`read_rows_at` results other than a hit count.
READ_OVERLAPPED = -1
READ_REMAP = -2


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
def read_rows_at(
    ctrl: np.ndarray,
    index: np.ndarray,
    index_gen: np.int64,
    keys: np.ndarray,
    rows: np.ndarray,
    versions: np.ndarray,
    stamps: np.ndarray,
    query: np.ndarray,
    positions: np.ndarray,
    out_vectors: np.ndarray,
    out_versions: np.ndarray,
    found: np.ndarray,
    row_ids: np.ndarray,
) -> int:
    """A lock-free read, by a process that is not the writer, of the keys ``query[positions]``: the row of
    ``query[positions[j]]`` goes to ``out_vectors[positions[j]]`` (a lookup's answer, filled only where L1 left a
    hole), its version to ``out_versions[j]``. Returns the number of hits, or ``READ_OVERLAPPED`` (a write
    overlapped: run again) or ``READ_REMAP`` (the index was replaced: map generation ``ctrl[CTRL_INDEX_GEN]`` and
    run again). Writes only its outputs; ``row_ids[j]`` is the row of each hit (-1 otherwise), for
    :func:`stamp_reads`. A read that overlapped a write may have left anything in the rows it was filling: the
    caller runs it again, which rewrites them.

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
    n = positions.size
    torn = False
    for j in range(n):
        key = query[positions[j]]
        pos = home_slot(key, mask)
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
        row_ids[j] = r
    if torn:
        return READ_OVERLAPPED
    for j in range(min(PREFETCH_AHEAD, n)):
        if row_ids[j] >= 0:
            prefetch_row(rows, versions, row_ids[j])
    hits = 0
    for j in range(n):
        ahead = j + PREFETCH_AHEAD
        if ahead < n and row_ids[ahead] >= 0:
            prefetch_row(rows, versions, row_ids[ahead])
        r = row_ids[j]
        if r < 0 or stamps[r] < 0:
            row_ids[j] = -1
            found[j] = False
            continue
        copy_row(out_vectors, positions[j], rows, r)
        out_versions[j] = versions[r]
        found[j] = True
        hits += 1
    acquire_fence()
    if atomic_load(ctrl, CTRL_SEQ) != seq:
        return READ_OVERLAPPED
    return hits


@njit(cache=True, nogil=True)
def stamp_reads(reader_stamps: np.ndarray, row_ids: np.ndarray, clock: np.int64, lfu: bool) -> None:
    """Record a validated read's hits for eviction: LRU, the clock's stamp (written only where it differs, so hot
    rows do not bounce their cache line between readers); LFU, one more access (racy across processes: a lost count
    only blurs the order). A row moved meanwhile gets a stamp it did not earn, which only affects eviction order."""
    stamp = live(clock)
    for i in range(row_ids.size):
        r = row_ids[i]
        if r < 0 or r >= reader_stamps.size:
            continue
        if lfu:
            reader_stamps[r] = counted(reader_stamps[r])
        elif reader_stamps[r] != stamp:
            reader_stamps[r] = stamp
