"""Compiled (numba) CPU kernels of the set-associative cache: probe and copy in one pass.

Each kernel does exactly what the xp reference in :mod:`hps_service.cache.set_assoc` does (the tests
compare them on the same operation sequences); the arrays are those of :class:`layout.CacheArrays`.
Keys are hashed as uint64 with the same splitmix64 finalizer; every integer constant is typed uint64 so
numba never mixes signed and unsigned (which it would promote to float). Kernels release the GIL so
concurrent readers run in parallel.

Readers take no lock: :func:`query_kernel` loads the sequence counter (``meta[META_SEQ]``) with acquire
ordering before it reads and again after, and returns -1 (answer discarded, nothing touched) when a
writer was inside or passed meanwhile. Only a validated read draws a tick and touches clocks, with
atomic adds, so a rerun can never count an access twice and concurrent readers lose no LFU counts.
Writers bump the counter to odd before they change anything and back to even after
(:func:`seq_begin`, :func:`seq_end`, full barriers), one writer at a time (the caller's mutex).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros as _numba_trailing_zeros

from hps_service.cache.layout import (
    CLOCK_MASK,
    FREE_SCORE,
    LFU_CAP,
    META_EVICTIONS,
    META_ROWS,
    META_SEQ,
    META_TICK,
    TAG_BIT,
    TAG_HASH_MASK,
    CacheArrays,
)
from hps_service.jit.atomic import acquire_fence, atomic_fetch_add, atomic_load
from hps_service.jit.hashing import mix64
from hps_service.jit.prefetch import prefetch
from hps_service.jit.rowcopy import copy_row
from hps_service.jit.ticks import age
from hps_service.jit.views import read_only_view

_S32 = np.uint64(32)
_TAG_BIT = np.uint64(TAG_BIT)
_TAG_MASK = np.uint64(TAG_HASH_MASK)
#: The count of trailing zero bits of a uint64 (LLVM cttz), as kernels call it.
_trailing_zeros = cast(Callable[[np.uint64], int], _numba_trailing_zeros)
_ONES = np.uint64(0x0101010101010101)
_HIGHS = np.uint64(0x8080808080808080)
_I64_MIN = np.iinfo(np.int64).min
_I64_MAX = np.iinfo(np.int64).max

#: How many keys apart the stages of the query pipeline run (tag rows prefetched, then key slot and value
#: row prefetched, then key compared and row copied); measured best of 8/16 (loadtest/benchmarks/cache.py).
PREFETCH_AHEAD = 16


@numba.njit(cache=True, inline="always")
def _set_of(x: np.uint64, sets: np.uint64) -> np.int64:
    return np.int64(((x >> _S32) * sets) >> _S32)


@numba.njit(cache=True, inline="always")
def _tag_of(x: np.uint64) -> np.uint8:
    return np.uint8(_TAG_BIT | (x & _TAG_MASK))


@numba.njit(cache=True, inline="always")
def _score(c, tick, lfu):
    # layout.scores for one slot: LFU, the count; LRU, minus the ticks since the access.
    return np.int64(c) if lfu else -age(tick, np.int64(c))


@numba.njit(cache=True, inline="always")
def _counted(c):
    return np.int32(c + 1) if c < LFU_CAP else c


@numba.njit(cache=True, inline="always")
def _find(tags, table, s, tag, key, start):
    for w in range(start, tags.shape[1]):
        if tags[s, w] == tag and table[s, w] == key:
            return w
    return -1


@numba.njit(cache=True, nogil=True)
def seq_begin(meta):
    """Writer: make the sequence odd before changing the cache (a full barrier)."""
    atomic_fetch_add(meta, META_SEQ, 1)


@numba.njit(cache=True, nogil=True)
def seq_end(meta):
    """Writer: make the sequence even after changing the cache (a full barrier)."""
    atomic_fetch_add(meta, META_SEQ, 1)


@numba.njit(cache=True, nogil=True)
def next_tick(meta):
    """Draw the next tick (an atomic add: concurrent readers each get their own)."""
    return atomic_fetch_add(meta, META_TICK, 1) + 1


@numba.njit(cache=True, nogil=True)
def query_kernel(tags, table, clock, values, meta, sets, lfu, touch, asked, out, hit):
    # Software-pipelined over three stages PREFETCH_AHEAD keys apart: the tag row of key j is prefetched;
    # the tags of key j-D are scanned (eight a step) and the candidate's key slot and value row prefetched;
    # the key of j-2D is compared and its row copied (one memcpy). Returns the number of hits, or -1 if a writer overlapped.
    # ``asked``: the int64 keys, compared as uint64 (``table`` is the cached keys viewed so): viewed here, not by callers.
    # The cache's arrays and settings come first, so that a caller binds them once (hps_service.jit.bound).
    seq = atomic_load(meta, META_SEQ)
    if seq & 1:
        return -1
    keys = asked.view(np.uint64)
    ways = tags.shape[1]
    # The tag rows as 8-byte words, scanned eight tags a step (no words when a row is not whole words).
    words = tags.ravel()[: (tags.size // 8) * 8].view(np.uint64)
    nw = ways // 8 if ways % 8 == 0 else 0
    dim = values.shape[1]
    usets = np.uint64(sets)
    n = keys.shape[0]
    ahead = PREFETCH_AHEAD
    set_idx = np.empty(n, np.int64)
    tag = np.empty(n, np.uint8)
    for i in range(n):
        x = mix64(keys[i])
        set_idx[i] = _set_of(x, usets)
        tag[i] = _tag_of(x)
    slots = np.empty(n, np.int64)
    nhit = 0
    for j in range(n + 2 * ahead):
        if j < n:
            prefetch(tags, set_idx[j], 0)
        i = j - ahead
        if 0 <= i < n:
            s = set_idx[i]
            w = -1
            if nw:
                # A zero byte of word ^ pattern is a tag match (the has-zero-byte trick): the lowest flagged
                # byte is exact, flags above it may be false, so a later candidate comes from _find.
                pattern = _ONES * np.uint64(tag[i])
                for q in range(nw):
                    x = words[s * nw + q] ^ pattern
                    z = (x - _ONES) & ~x & _HIGHS
                    if z != 0:
                        w = q * 8 + int(_trailing_zeros(z) >> 3)
                        break
            else:
                t = tag[i]
                for v in range(ways):
                    if tags[s, v] == t:
                        w = v
                        break
            slots[i] = w
            if w >= 0:
                prefetch(table, s, w)
                slot = s * ways + w
                for d in range(0, dim, 16):
                    prefetch(values, slot, d)
        i = j - 2 * ahead
        if i >= 0:
            w = slots[i]
            s = set_idx[i]
            if w >= 0 and table[s, w] != keys[i]:
                w = _find(tags, table, s, tag[i], keys[i], w + 1)
            if w < 0:
                hit[i] = False
                slots[i] = -1
            else:
                slot = s * ways + w
                copy_row(out, i, values, slot)
                hit[i] = True
                slots[i] = slot
                nhit += 1
    acquire_fence()
    if atomic_load(meta, META_SEQ) != seq:
        return -1
    if touch:
        tick = atomic_fetch_add(meta, META_TICK, 1) + 1
        stamp = np.int32(tick & CLOCK_MASK)
        flat_clock = clock.ravel()
        for i in range(n):
            slot = slots[i]
            if slot >= 0:
                if not lfu:
                    flat_clock[slot] = stamp
                elif flat_clock[slot] < LFU_CAP:  # concurrent adds past the check stay far below 2**31
                    atomic_fetch_add(flat_clock, slot, 1)
    return nhit


@numba.njit(cache=True, nogil=True)
def _insert(tags, table, vers, clock, values, meta, keys, vectors, versions, sets, lfu, evict):
    ways = tags.shape[1]
    dim = values.shape[1]
    usets = np.uint64(sets)
    n = keys.shape[0]
    tick = atomic_fetch_add(meta, META_TICK, 1) + 1
    stamp = np.int32(tick & CLOCK_MASK)
    set_of = np.empty(n, np.int64)
    tag_of = np.empty(n, np.uint8)
    new = np.empty(n, np.int64)
    m = 0
    overwritten = 0
    stale = 0
    for i in range(n):
        k = keys[i]
        x = mix64(k)
        s = _set_of(x, usets)
        t = _tag_of(x)
        set_of[i] = s
        tag_of[i] = t
        w = _find(tags, table, s, t, k, 0)
        if w < 0:
            new[m] = i
            m += 1
            continue
        if vers[s, w] > versions[i]:
            stale += 1
            continue
        slot = s * ways + w
        for d in range(dim):
            values[slot, d] = vectors[i, d]
        vers[s, w] = versions[i]
        if lfu:
            clock[s, w] = _counted(clock[s, w])
        else:
            clock[s, w] = stamp
        overwritten += 1
    new = new[:m]
    order = np.argsort(set_of[new], kind="mergesort")
    new_clock = np.int32(1) if lfu else stamp
    priority = np.empty(ways, np.int64)
    placed = 0
    evicted = 0
    j = 0
    while j < m:
        s = set_of[new[order[j]]]
        e = j
        while e < m and set_of[new[order[e]]] == s:
            e += 1
        for w in range(ways):
            if tags[s, w] == 0:
                priority[w] = FREE_SCORE * ways + w
            else:
                priority[w] = _score(clock[s, w], tick, lfu) * ways + w
        # The r-th new key of this set takes the slot with the r-th lowest priority (priorities are distinct):
        # repeated min-scans above the last one taken, no per-set sort or allocation (usually r is 1 or 2).
        taken = _I64_MIN
        for r in range(min(e - j, ways)):
            w = -1
            best = _I64_MAX
            for v in range(ways):
                p = priority[v]
                if taken < p < best:
                    best = p
                    w = v
            taken = best
            if tags[s, w] != 0:
                if not evict:
                    break
                evicted += 1
            i = new[order[j + r]]
            tags[s, w] = tag_of[i]
            table[s, w] = keys[i]
            vers[s, w] = versions[i]
            clock[s, w] = new_clock
            slot = s * ways + w
            for d in range(dim):
                values[slot, d] = vectors[i, d]
            placed += 1
        j = e
    meta[META_ROWS] += placed - evicted
    meta[META_EVICTIONS] += evicted
    return overwritten + placed, placed, evicted, m - placed, stale


@numba.njit(cache=True, nogil=True)
def _update(tags, table, vers, values, keys, vectors, versions, sets):
    ways = tags.shape[1]
    dim = values.shape[1]
    usets = np.uint64(sets)
    written = np.zeros(keys.shape[0], np.bool_)
    for i in range(keys.shape[0]):
        k = keys[i]
        x = mix64(k)
        s = _set_of(x, usets)
        w = _find(tags, table, s, _tag_of(x), k, 0)
        if w < 0 or vers[s, w] > versions[i]:
            continue
        slot = s * ways + w
        for d in range(dim):
            values[slot, d] = vectors[i, d]
        vers[s, w] = versions[i]
        written[i] = True
    # Distinct keys overwritten: a duplicate of a key counts once.
    return _distinct(keys, written)


@numba.njit(cache=True, nogil=True)
def _invalidate(tags, table, vers, clock, meta, keys, versions, versioned, sets):
    usets = np.uint64(sets)
    removed = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        x = mix64(k)
        s = _set_of(x, usets)
        w = _find(tags, table, s, _tag_of(x), k, 0)
        if w >= 0 and (not versioned or vers[s, w] <= versions[i]):
            tags[s, w] = 0
            clock[s, w] = 0
            removed += 1
    meta[META_ROWS] -= removed
    return removed


@numba.njit(cache=True, nogil=True, inline="always")
def _slots_for(n: int) -> int:
    """A power of two at least twice ``n``: the size of an open-addressing set of ``n`` keys."""
    size = 2
    while size < 2 * n:
        size *= 2
    return size


@numba.njit(cache=True, nogil=True)
def _latest_per_key(keys, versions, keep):
    # Fills keep and returns a count (returning an array would box it through numba's unpickling per call). One
    # pass over an open-addressing set (slot -> the entry kept so far for its key), O(n) and no sort to compile:
    # the highest version wins, the last in batch order among equals.
    n = keys.shape[0]
    size = _slots_for(n)
    mask = np.uint64(size - 1)
    slots = np.full(size, -1, np.int64)
    chosen = np.zeros(n, np.bool_)
    for i in range(n):
        k = keys[i]
        s = mix64(np.uint64(k)) & mask
        while True:
            held = slots[s]
            if held < 0:
                slots[s] = i
                chosen[i] = True
                break
            if keys[held] == k:
                if versions[i] >= versions[held]:
                    chosen[held] = False
                    chosen[i] = True
                    slots[s] = i
                break
            s = (s + np.uint64(1)) & mask
    m = 0
    for i in range(n):
        if chosen[i]:
            keep[m] = i
            m += 1
    return m


@numba.njit(cache=True, nogil=True)
def _distinct(keys, mask_in):
    # How many distinct keys[i] have mask_in[i]: an open-addressing set, as _latest_per_key (no sort to compile).
    n = 0
    for i in range(keys.shape[0]):
        n += mask_in[i]
    size = _slots_for(n)
    mask = np.uint64(size - 1)
    slots = np.full(size, -1, np.int64)
    count = 0
    for i in range(keys.shape[0]):
        if not mask_in[i]:
            continue
        k = keys[i]
        s = mix64(np.uint64(k)) & mask
        while True:
            held = slots[s]
            if held < 0:
                slots[s] = i
                count += 1
                break
            if keys[held] == k:
                break
            s = (s + np.uint64(1)) & mask
    return count


def latest_per_key(keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """Indices keeping one entry per key, the highest version (the last among equals), in batch order."""
    keep = np.empty(keys.shape[0], dtype=np.int64)
    return keep[: _latest_per_key(np.ascontiguousarray(keys), np.ascontiguousarray(versions), keep)]


def _u64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint64)


def insert(arrays: CacheArrays, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, lfu: bool,
           evict: bool) -> tuple[int, int, int, int, int]:
    """Insert deduplicated keys; returns (written, placed, evicted, dropped, stale)."""
    a = arrays
    counts: tuple[int, int, int, int, int] = _insert(a.tags, a.keys.view(np.uint64), a.versions, a.clock, a.values, a.meta, _u64(keys),
                   np.ascontiguousarray(vectors), np.ascontiguousarray(versions), a.sets, lfu, evict)
    return counts


def update(arrays: CacheArrays, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> int:
    """Overwrite rows of cached keys not newer than the update, in batch order; returns distinct keys written."""
    a = arrays
    # the rows written arrive writable (REST) or read-only (the update log's bytes): one specialisation of each
    written: int = _update(a.tags, a.keys.view(np.uint64), a.versions, a.values, read_only_view(_u64(keys)),
                           read_only_view(np.ascontiguousarray(vectors)),
                           read_only_view(np.ascontiguousarray(versions)), a.sets)
    return written


def invalidate(arrays: CacheArrays, keys: np.ndarray, versions: np.ndarray | None) -> int:
    """Free the slots of cached keys (with versions: only rows not newer than the delete); returns how many."""
    a = arrays
    versioned = versions is not None
    vs = np.ascontiguousarray(versions) if versioned else np.zeros(keys.shape[0], np.int64)
    freed: int = _invalidate(a.tags, a.keys.view(np.uint64), a.versions, a.clock, a.meta, read_only_view(_u64(keys)),
                             read_only_view(vs), versioned, a.sets)
    return freed
