"""One compiled pass over a hash-map table, from a lookup's keys to its answer's rows: the read of a table without L1.

:func:`lane_kernel` probes every key and copies each held row straight into the answer (a view of the response being
encoded), marks its source, lists the keys it does not hold for the caller's general path, stamps the rows it read
for eviction and reports whether the table is *complete* (:mod:`.complete`): all under one sequence-lock read, so a
miss of a complete table is known to have no stored row. Software-pipelined in three stages ``PREFETCH_AHEAD`` keys
apart, as the L1 query is: the key's index slot is prefetched; its slot is read and the candidate's metadata line and
row prefetched; the candidate's key is compared (probing on where it differs) and its row copied.

:class:`Lane` binds it to one table's arrays (:mod:`hps_service.jit.bound`): a node's workers and colocated readers
call it lock-free (reads a write overlapped run again), the owner with the table's lock held.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from numba import njit

from hps_service.errors import InvalidArgumentError
from hps_service.jit.atomic import acquire_fence, atomic_fetch_add, atomic_load
from hps_service.jit.bound import bind_kernel
from hps_service.jit.hashing import home_slot
from hps_service.jit.prefetch import prefetch
from hps_service.jit.rowcopy import copy_row
from hps_service.jit.ticks import age
from hps_service.tiers.hashmap.index import PREFETCH_AHEAD
from hps_service.tiers.hashmap.seqlock import (
    CTRL_CLOCK,
    CTRL_COMPLETE,
    CTRL_INDEX_GEN,
    CTRL_SEQ,
    READ_OVERLAPPED,
    READ_REMAP,
)
from hps_service.tiers.hashmap.stamps import counted, live

#: What the pass writes into ``sources`` for a row it copied: ``hps.v1.Source`` VOLATILE (engine.levels.VOLATILE,
#: which the engine, above the tiers, defines).
SOURCE_VOLATILE = 2
#: A row read is stamped again once its stamp is this many ticks (batches) old: the rows every batch reads do not
#: move their metadata line between the workers' cores on every batch, and LRU order is kept to that resolution.
STAMP_EVERY = 256
#: Back-off of a reader that keeps overlapping writes (as ``reader.TableReader``'s).
_SPINS, _SLEEP_S, _SLEEP_CAP_S = 8, 20e-6, 2e-3


@njit(cache=True, nogil=True)
def lane_kernel(ctrl: np.ndarray, clock: np.ndarray, keys: np.ndarray, stamps: np.ndarray, rows: np.ndarray,
                reader_stamps: np.ndarray, lfu: bool, stamp: bool, index: np.ndarray, index_gen: np.int64,
                query: np.ndarray, out: np.ndarray, sources: np.ndarray, miss: np.ndarray) -> tuple[int, bool]:
    """See the module docstring."""
    # Returns (hits, complete), or (READ_OVERLAPPED / READ_REMAP, False). ``ctrl``: the table's control array, read
    # only; ``clock``: where the table clock ticks (the same array for a worker, a private one for a read-only
    # reader); ``stamp``: record the hits for eviction in ``reader_stamps``. The hits' rows go to ``out[i]`` and
    # ``sources[i] = VOLATILE``; the other keys' indices to ``miss[:n - hits]``, in order. A read a write overlapped
    # may have written anything into ``out`` and ``sources``: the caller runs it again.
    seq = atomic_load(ctrl, CTRL_SEQ)
    if seq & 1:
        return READ_OVERLAPPED, False
    if atomic_load(ctrl, CTRL_INDEX_GEN) != index_gen:
        return READ_REMAP, False
    complete = ctrl[CTRL_COMPLETE] != 0
    size = index.shape[0]
    mask = np.int64(size - 1)
    capacity = rows.shape[0]
    dim = rows.shape[1]
    n = query.shape[0]
    ahead = PREFETCH_AHEAD
    home = np.empty(n, np.int64)
    for i in range(n):
        home[i] = home_slot(query[i], mask)
    row_ids = np.empty(n, np.int64)
    hits = 0
    missed = 0
    torn = False
    for j in range(n + 2 * ahead):
        if j < n:
            prefetch(index, home[j], 0)
        i = j - ahead
        if 0 <= i < n:
            r = np.int64(index[home[i]])
            if r >= capacity:
                torn = True
                break
            row_ids[i] = r
            if r >= 0:
                prefetch(keys, r, 0)
                for d in range(0, dim, 16):
                    prefetch(rows, r, d)
        i = j - 2 * ahead
        if i >= 0:
            key = query[i]
            r = row_ids[i]
            if r >= 0 and keys[r] != key:
                pos = home[i]
                r = np.int64(-1)
                for _ in range(size):
                    pos = (pos + 1) & mask
                    cand = np.int64(index[pos])
                    if cand < 0:
                        break
                    if cand >= capacity:
                        torn = True
                        break
                    if keys[cand] == key:
                        r = cand
                        break
                if torn:
                    break
            if r >= 0 and stamps[r] >= 0:  # held, and not a tombstone
                copy_row(out, i, rows, r)
                sources[i] = SOURCE_VOLATILE
                row_ids[i] = r
                hits += 1
            else:
                row_ids[i] = -1
                miss[missed] = i
                missed += 1
    if torn:
        return READ_OVERLAPPED, False
    acquire_fence()
    if atomic_load(ctrl, CTRL_SEQ) != seq:
        return READ_OVERLAPPED, False
    if stamp and hits:
        if lfu:
            for i in range(n):
                r = row_ids[i]
                if r >= 0:
                    reader_stamps[r] = counted(reader_stamps[r])
        else:
            tick = atomic_fetch_add(clock, CTRL_CLOCK, 1) + 1
            now = live(tick)
            for i in range(n):
                r = row_ids[i]
                if r >= 0 and (reader_stamps[r] == 0 or age(tick, np.int64(reader_stamps[r])) >= STAMP_EVERY):
                    reader_stamps[r] = now
    return hits, complete


def check_answer(out: np.ndarray, sources: np.ndarray, n: int, words: int) -> None:
    """InvalidArgumentError unless ``out`` and ``sources`` are what the compiled pass writes into unchecked: writable
    C-contiguous float32 ``(n, words)`` and uint8 ``(n,)``."""
    if (out.dtype != np.float32 or out.shape != (n, words) or not out.flags.c_contiguous or not out.flags.writeable
            or sources.dtype != np.uint8 or sources.shape != (n,) or not sources.flags.c_contiguous
            or not sources.flags.writeable):
        raise InvalidArgumentError(f"the answer of {n} keys needs writable C-contiguous float32 rows of shape "
                                   f"({n}, {words}) and uint8 sources of shape ({n},), got {out.dtype} {out.shape} "
                                   f"and {sources.dtype} {sources.shape}")


def _writable_standin(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A writable array of ``shape`` that the kernel compiles against but never writes (one element, zero strides)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape, strides=(0,) * len(shape), writeable=True)


class Lane:
    """:func:`lane_kernel` bound to one table's arrays. ``read(keys, out, sources, miss)`` takes read-only C-contiguous
    int64 ``keys``, writable C-contiguous float32 ``out`` of ``(n, words)``, uint8 ``sources`` and int64 ``miss`` of
    ``(n,)`` (unchecked: the compiled call trusts them) and returns ``(hits, complete)``."""

    def __init__(self, ctrl: np.ndarray, meta: np.ndarray, rows: np.ndarray, reader_stamps: np.ndarray | None,
                 owner_stamps: np.ndarray, lfu: bool, index: Callable[[], tuple[np.ndarray, int]],
                 remap: Callable[[], None]) -> None:
        """``reader_stamps``: where the hits are stamped (None: a read-only reader, which records nothing);
        ``owner_stamps``: the owner's half, whose sign marks tombstones; ``index()``: the index and its generation
        as mapped now; ``remap()``: map the generation the writer published."""
        from hps_service.jit.views import read_only_view

        writable = ctrl.flags.writeable and reader_stamps is not None
        fixed = (read_only_view(ctrl), ctrl if writable else np.zeros_like(ctrl), read_only_view(meta[:, 0]),
                 read_only_view(owner_stamps), read_only_view(rows),
                 reader_stamps if reader_stamps is not None else _writable_standin(owner_stamps.shape, np.int32),
                 lfu, reader_stamps is not None)
        self.words = rows.shape[1]
        self._index = index
        self._remap = remap
        idx, _ = index()
        sample = (read_only_view(idx), np.int64(0), read_only_view(np.empty(0, np.int64)),
                  np.empty((0, rows.shape[1]), np.float32), np.empty(0, np.uint8), np.empty(0, np.int64))
        self._kernel = bind_kernel(lane_kernel, fixed, sample)
        self.retries = 0

    def read(self, keys: np.ndarray, out: np.ndarray, sources: np.ndarray, miss: np.ndarray) -> tuple[int, bool]:
        """The pass, run again while writes overlap it (backing off) and after the index was replaced."""
        attempt = 0
        sleep = _SLEEP_S
        while True:
            index, gen = self._index()
            got, complete = self._kernel(index, gen, keys, out, sources, miss)
            if got >= 0:
                return int(got), bool(complete)
            if got == READ_REMAP:
                self._remap()
                continue
            self.retries += 1
            attempt += 1
            if attempt > _SPINS:
                time.sleep(sleep)
                sleep = min(2 * sleep, _SLEEP_CAP_S)
