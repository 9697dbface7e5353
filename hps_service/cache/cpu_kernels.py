"""Compiled (numba) CPU kernels of the set-associative cache: probe and copy in one pass.

Each kernel does exactly what the xp reference in :mod:`hps_service.cache.set_assoc` does (the tests
compare them on the same operation sequences). Keys are hashed as uint64 with the same splitmix64
finalizer; every integer constant is typed uint64 so numba never mixes signed and unsigned (which it
would promote to float). Kernels release the GIL so concurrent readers run in parallel.
"""

from __future__ import annotations

import numba
import numpy as np

from hps_service.hashing import mix64
from hps_service.numba_prefetch import prefetch

_S32 = np.uint64(32)
_EMPTY = np.uint64(1 << 63)
_I64_MIN = np.iinfo(np.int64).min
_I64_MAX = np.iinfo(np.int64).max


@numba.njit(cache=True, inline="always")
def _set_of(key: np.uint64, sets: np.uint64) -> np.int64:
    return np.int64(((mix64(key) >> _S32) * sets) >> _S32)


@numba.njit(cache=True, inline="always")
def _find(table: np.ndarray, s: np.int64, key: np.uint64) -> np.int64:
    for w in range(table.shape[1]):
        if table[s, w] == key:
            return w
    return -1


#: How many keys ahead the query prefetches set rows (probe loop) and value rows (copy loop); measured best of 8/16.
PREFETCH_AHEAD = 16


@numba.njit(cache=True, nogil=True)
def query_kernel(table, clock, values, keys, out, hit, sets, tick, lfu):
    # Software-pipelined: the probe of key i runs while the set rows of keys i+1..i+D are being fetched, and
    # the copy of row i while the value rows of i+1..i+D are; then the clocks are touched in a last pass.
    # Measured against the plain probe-then-copy loop on the same data: 0.44-0.47x -> 0.51-0.53x of a raw
    # gather at batch 1024, 0.40-0.48x -> 0.68-0.72x at 4096 (loadtest/bench_cache.py).
    ways = table.shape[1]
    dim = values.shape[1]
    usets = np.uint64(sets)
    n = keys.shape[0]
    ahead = PREFETCH_AHEAD
    set_idx = np.empty(n, np.int64)
    for i in range(n):
        set_idx[i] = _set_of(keys[i], usets)
    slots = np.empty(n, np.int64)
    nhit = 0
    for j in range(n + ahead):
        if j < n:
            s = set_idx[j]
            for c in range(0, ways, 8):
                prefetch(table, s, c)
        i = j - ahead
        if i >= 0:
            s = set_idx[i]
            w = _find(table, s, keys[i])
            if w < 0:
                hit[i] = False
                slots[i] = -1
            else:
                hit[i] = True
                slots[i] = s * ways + w
                nhit += 1
    for j in range(n + ahead):
        if j < n:
            slot = slots[j]
            if slot >= 0:
                for d in range(0, dim, 16):
                    prefetch(values, slot, d)
        i = j - ahead
        if i >= 0:
            slot = slots[i]
            if slot >= 0:
                for d in range(dim):
                    out[i, d] = values[slot, d]
    flat_clock = clock.ravel()
    for i in range(n):
        slot = slots[i]
        if slot >= 0:
            if lfu:
                flat_clock[slot] += 1
            else:
                flat_clock[slot] = tick
    return nhit


@numba.njit(cache=True, nogil=True)
def _insert(table, clock, values, keys, vectors, sets, tick, lfu, evict):
    ways = table.shape[1]
    dim = values.shape[1]
    usets = np.uint64(sets)
    n = keys.shape[0]
    set_of = np.empty(n, np.int64)
    new = np.empty(n, np.int64)
    m = 0
    overwritten = 0
    for i in range(n):
        k = keys[i]
        s = _set_of(k, usets)
        set_of[i] = s
        w = _find(table, s, k)
        if w < 0:
            new[m] = i
            m += 1
            continue
        slot = s * ways + w
        for d in range(dim):
            values[slot, d] = vectors[i, d]
        if lfu:
            clock[s, w] += 1
        else:
            clock[s, w] = tick
        overwritten += 1
    new = new[:m]
    order = np.argsort(set_of[new], kind="mergesort")
    new_clock = 1 if lfu else tick
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
            if table[s, w] == _EMPTY:
                priority[w] = -ways + w
            else:
                priority[w] = clock[s, w] * ways + w
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
            if table[s, w] != _EMPTY:
                if not evict:
                    break
                evicted += 1
            i = new[order[j + r]]
            table[s, w] = keys[i]
            clock[s, w] = new_clock
            slot = s * ways + w
            for d in range(dim):
                values[slot, d] = vectors[i, d]
            placed += 1
        j = e
    return overwritten + placed, placed, evicted, m - placed


@numba.njit(cache=True, nogil=True)
def _update(table, values, keys, vectors, sets):
    ways = table.shape[1]
    dim = values.shape[1]
    usets = np.uint64(sets)
    present = np.zeros(keys.shape[0], np.bool_)
    for i in range(keys.shape[0]):
        k = keys[i]
        s = _set_of(k, usets)
        w = _find(table, s, k)
        if w < 0:
            continue
        slot = s * ways + w
        for d in range(dim):
            values[slot, d] = vectors[i, d]
        present[i] = True
    # Distinct cached keys: a duplicate of a key counts once.
    return np.unique(keys[present]).shape[0]


@numba.njit(cache=True, nogil=True)
def _invalidate(table, clock, keys, sets):
    usets = np.uint64(sets)
    removed = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        s = _set_of(k, usets)
        w = _find(table, s, k)
        if w >= 0:
            table[s, w] = _EMPTY
            clock[s, w] = 0
            removed += 1
    return removed


@numba.njit(cache=True, nogil=True)
def _last_occurrence(keys, keep):
    # Fills keep and returns a count (returning an array would box it through numba's unpickling per call).
    n = keys.shape[0]
    order = np.argsort(keys, kind="mergesort")  # stable: the last of a run of equal keys is the latest one
    m = 0
    for j in range(n):
        if j == n - 1 or keys[order[j + 1]] != keys[order[j]]:
            keep[m] = order[j]
            m += 1
    keep[:m].sort()
    return m


def last_occurrence(keys: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each distinct key, in batch order (``set_assoc.last_occurrence``, compiled)."""
    keep = np.empty(keys.shape[0], dtype=np.int64)
    return keep[: _last_occurrence(np.ascontiguousarray(keys), keep)]


def _u64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint64)


def query(
    table: np.ndarray, clock: np.ndarray, values: np.ndarray, keys: np.ndarray, out: np.ndarray,
    hit: np.ndarray, sets: int, tick: int, lfu: bool,
) -> int:
    """Probe and copy hits into ``out``, set ``hit``, touch clocks; returns the number of hits."""
    return query_kernel(table.view(np.uint64), clock, values, _u64(keys), out, hit, sets, tick, lfu)


def insert(
    table: np.ndarray, clock: np.ndarray, values: np.ndarray, keys: np.ndarray, vectors: np.ndarray,
    sets: int, tick: int, lfu: bool, evict: bool,
) -> tuple[int, int, int, int]:
    """Insert deduplicated keys; returns (written, placed, evicted, dropped)."""
    return _insert(table.view(np.uint64), clock, values, _u64(keys), np.ascontiguousarray(vectors), sets,
                   tick, lfu, evict)


def update(table: np.ndarray, values: np.ndarray, keys: np.ndarray, vectors: np.ndarray, sets: int) -> int:
    """Overwrite rows of cached keys in batch order (the last duplicate wins); returns distinct cached keys."""
    return _update(table.view(np.uint64), values, _u64(keys), np.ascontiguousarray(vectors), sets)


def invalidate(table: np.ndarray, clock: np.ndarray, keys: np.ndarray, sets: int) -> int:
    """Free the slots of cached keys; returns how many were cached."""
    return _invalidate(table.view(np.uint64), clock, _u64(keys), sets)
