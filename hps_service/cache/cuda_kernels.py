"""CUDA kernels of the set-associative cache (numba-cuda): query, insert with eviction, versioned update,
invalidate, clear, and the device-side sequence lock.

The same source runs on a GPU and, with ``NUMBA_ENABLE_CUDASIM=1``, in numba's CUDA simulator on the CPU,
which is how ``make test`` checks it against the NumPy reference. Arrays are the flat (1-D) device views of
:class:`hps_service.cache.layout.CacheArrays` (slot ``s * ways + w``; row element ``slot * dim + d``);
keys are uint64 views so hashing never mixes signed and unsigned. Lanes per key and keys per block come
from the launch (``blockDim.x`` lanes, ``blockDim.y`` keys), so the simulator runs the same code on 2-4
lanes where a GPU uses a warp of 32.

How a lock-free reader never keeps a torn row (a device-side sequence lock): a write runs on the writer's
stream as ``seq_bump`` (the counter turns odd) -> the write kernel -> ``seq_bump`` (even again); kernels of
one stream run in order, and each bump is an atomic with fences on both sides, so every slot a write
changes is changed after the counter turned odd and before it turned even. Each block of a query reads the
counter atomically before it reads any slot and again after (a fence and a barrier in between); its keys
are answered only if the counter was even and unchanged, else they are marked RETRY and touch nothing, and
the host reruns just those keys. Slot reads bypass the SM's L1 (``ld.global.cg``), so a block cannot see a
line cached before a write next to one read after it. Clocks are touched only by validated blocks, so a
rerun never counts an access twice.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda

from hps_service.cache.layout import (
    CLOCK_MASK,
    FREE_SCORE,
    LFU_CAP,
    META_EVICTIONS,
    META_ROWS,
    META_SEQ,
    TAG_BIT,
    TAG_HASH_MASK,
)
from hps_service.jit.hashing import mix64_array
from hps_service.jit.ticks import signed_age

#: Source byte of a key after a query: not cached, cached (row written), or read overlapped by a write.
MISS, HIT, RETRY = 0, 1, 2
#: Most keys one query block handles (shared-memory size); the launch's blockDim.y must not exceed it.
MAX_KEYS_PER_BLOCK = 64
#: The cache's ``ways`` limit (config: at most 1024): size of an insert leader's slot-priority snapshot.
MAX_WAYS = 1024
SIMULATED = bool(getattr(config, "ENABLE_CUDASIM", 0))  # set from the environment as numba starts: not in its stubs

_S32 = np.uint64(32)
_TAG_BIT = np.uint64(TAG_BIT)
_TAG_MASK = np.uint64(TAG_HASH_MASK)
_I64_MIN = np.int64(np.iinfo(np.int64).min)
_I64_MAX = np.int64(np.iinfo(np.int64).max)

if SIMULATED:

    @cuda.jit(device=True)
    def load(array, i):
        """The simulator has no cache-hinted loads (and no L1 to bypass)."""
        return array[i]

else:
    load = cuda.ldcg


#: The splitmix64 finalizer of :mod:`hps_service.jit.hashing` (the same source as the CPU kernels'), as device code.
_mix64 = cuda.jit(device=True, inline=True)(mix64_array)


@cuda.jit(device=True, inline=True)
def _set_of(x, sets):
    return np.int64(((x >> _S32) * np.uint64(sets)) >> _S32)


@cuda.jit(device=True, inline=True)
def _tag_of(x):
    return np.uint8(_TAG_BIT | (x & _TAG_MASK))


#: :func:`hps_service.jit.ticks.signed_age` (the same source as the CPU kernels'), as device code.
_age = cuda.jit(device=True, inline=True)(signed_age)


@cuda.jit(device=True, inline=True)
def _score(c, tick, lfu):
    """``layout.scores`` for one slot: LFU, the count; LRU, minus the ticks since the access."""
    if lfu:
        return np.int64(c)
    return -_age(tick, np.int64(c))


@cuda.jit(device=True, inline=True)
def _find(tags, table, s, ways, tag, key):
    base = s * ways
    for w in range(ways):
        if tags[base + w] == tag and table[base + w] == key:
            return w
    return -1


@cuda.jit
def seq_bump(meta):
    """One thread: the sequence counter goes odd (before a write) or even (after), fenced on both sides."""
    if cuda.grid(1) == 0:
        cuda.threadfence()
        cuda.atomic.add(meta, META_SEQ, 1)
        cuda.threadfence()


@cuda.jit
def query_kernel(tags, table, clock, values, meta, keys, out, src, n, sets, ways, dim, tick, lfu, touch,
                 retry_only):
    """Probe and copy hit rows straight into ``out`` (flat ``n * dim``); one source byte per key in ``src``."""
    lanes = cuda.blockDim.x
    lane = cuda.threadIdx.x
    row = cuda.threadIdx.y
    first = lane == 0 and row == 0
    found = cuda.shared.array(MAX_KEYS_PER_BLOCK, np.int32)
    seqs = cuda.shared.array(2, np.int64)
    i = cuda.blockIdx.x * cuda.blockDim.y + row
    if first:
        seqs[0] = cuda.atomic.add(meta, META_SEQ, 0)
    if lane == 0:
        found[row] = -1
    cuda.syncthreads()
    seq = seqs[0]
    active = i < n
    if active and retry_only:
        active = src[i] == RETRY
    s = np.int64(0)
    if active and (seq & 1) == 0:
        key = keys[i]
        x = _mix64(key)
        s = _set_of(x, sets)
        tag = _tag_of(x)
        for base in range(0, ways, lanes):
            w = base + lane
            if w < ways and load(tags, s * ways + w) == tag and load(table, s * ways + w) == key:
                found[row] = w  # keys of a set are distinct: at most one lane writes
    cuda.syncthreads()
    w = found[row]
    slot = s * ways + w
    if active and w >= 0:
        for d in range(lane, dim, lanes):
            out[i * dim + d] = load(values, slot * dim + d)
    cuda.threadfence()
    cuda.syncthreads()
    if first:
        seqs[1] = cuda.atomic.add(meta, META_SEQ, 0)
    cuda.syncthreads()
    valid = (seq & 1) == 0 and seqs[1] == seq
    if active and lane == 0:
        if not valid:
            src[i] = RETRY
        elif w < 0:
            src[i] = MISS
        else:
            src[i] = HIT
            if touch:
                if not lfu:
                    clock[slot] = np.int32(tick & CLOCK_MASK)
                elif clock[slot] < LFU_CAP:  # concurrent adds past the check stay far below 2**31
                    cuda.atomic.add(clock, slot, 1)


@cuda.jit
def insert_kernel(tags, table, vers, clock, values, meta, keys, vectors, versions, set_of, tag_of, order, new,
                  n, ways, dim, tick, lfu, evict, result):
    """One thread per set touched (the first of its keys in ``order``, keys sorted by set, batch order kept)
    does what the CPU kernel does for that set: overwrite cached keys not newer, then place new keys by
    (free, ``layout.scores``, way) priority. ``result``: written, placed, evicted, dropped, stale (atomic adds)."""
    p = cuda.grid(1)
    if p >= n:
        return
    s = set_of[order[p]]
    if p > 0 and set_of[order[p - 1]] == s:
        return
    e = p
    while e < n and set_of[order[e]] == s:
        e += 1
    overwritten = 0
    stale = 0
    m = 0
    for q in range(p, e):
        k = order[q]
        w = _find(tags, table, s, ways, tag_of[k], keys[k])
        new[q] = 0
        if w < 0:
            new[q] = 1
            m += 1
            continue
        slot = s * ways + w
        if vers[slot] > versions[k]:
            stale += 1
            continue
        for d in range(dim):
            values[slot * dim + d] = vectors[k * dim + d]
        vers[slot] = versions[k]
        if not lfu:
            clock[slot] = np.int32(tick & CLOCK_MASK)
        elif clock[slot] < LFU_CAP:
            clock[slot] += 1
        overwritten += 1
    placed = 0
    evicted = 0
    if m > 0:
        priority = cuda.local.array(MAX_WAYS, np.int64)
        for w in range(ways):
            if tags[s * ways + w] == 0:
                priority[w] = FREE_SCORE * ways + w
            else:
                priority[w] = _score(clock[s * ways + w], tick, lfu) * ways + w
        taken = _I64_MIN
        q = p
        for _r in range(min(m, ways)):
            while new[q] == 0:
                q += 1
            w = -1
            best = _I64_MAX
            for v in range(ways):
                pv = priority[v]
                if taken < pv < best:
                    best = pv
                    w = v
            taken = best
            slot = s * ways + w
            if tags[slot] != 0:
                if not evict:
                    break
                evicted += 1
            k = order[q]
            tags[slot] = tag_of[k]
            table[slot] = keys[k]
            vers[slot] = versions[k]
            clock[slot] = 1 if lfu else np.int32(tick & CLOCK_MASK)
            for d in range(dim):
                values[slot * dim + d] = vectors[k * dim + d]
            placed += 1
            q += 1
    cuda.atomic.add(result, 0, overwritten + placed)
    cuda.atomic.add(result, 1, placed)
    cuda.atomic.add(result, 2, evicted)
    cuda.atomic.add(result, 3, m - placed)
    cuda.atomic.add(result, 4, stale)
    cuda.atomic.add(meta, META_ROWS, placed - evicted)
    cuda.atomic.add(meta, META_EVICTIONS, evicted)


@cuda.jit
def update_kernel(tags, table, vers, values, keys, vectors, versions, n, sets, ways, dim, result):
    """One thread per (distinct) key: overwrite the cached row if its version is not newer."""
    i = cuda.grid(1)
    if i >= n:
        return
    key = keys[i]
    x = _mix64(key)
    s = _set_of(x, sets)
    w = _find(tags, table, s, ways, _tag_of(x), key)
    if w < 0:
        return
    slot = s * ways + w
    if vers[slot] > versions[i]:
        return
    for d in range(dim):
        values[slot * dim + d] = vectors[i * dim + d]
    vers[slot] = versions[i]
    cuda.atomic.add(result, 0, 1)


@cuda.jit
def invalidate_kernel(tags, table, vers, clock, meta, keys, versions, versioned, n, sets, ways, result):
    """One thread per (distinct) key: free its slot (versioned: only a row not newer than the delete)."""
    i = cuda.grid(1)
    if i >= n:
        return
    key = keys[i]
    x = _mix64(key)
    s = _set_of(x, sets)
    w = _find(tags, table, s, ways, _tag_of(x), key)
    if w < 0:
        return
    slot = s * ways + w
    if versioned and vers[slot] > versions[i]:
        return
    tags[slot] = 0
    clock[slot] = 0
    cuda.atomic.add(result, 0, 1)
    cuda.atomic.add(meta, META_ROWS, -1)


@cuda.jit
def fill_kernel(array, value):
    """Grid-stride fill of a flat array (zeroing at allocation, clear)."""
    start = cuda.grid(1)
    step = cuda.gridsize(1)
    for i in range(start, array.shape[0], step):
        array[i] = value
