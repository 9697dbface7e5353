"""A set-associative embedding cache in host memory: compiled (numba) kernels and a NumPy reference.

The state is the arrays of :class:`hps_service.cache.layout.CacheArrays` (slot tags, keys, versions,
clocks, rows, and the meta counters), which a caller may allocate (shared memory). A key lives only in
set ``mix64(key)`` high 32 bits scaled to ``[0, sets)``, with tag ``0x80 | (mix64(key) & 0x7F)``. The
NumPy code below is the reference; the compiled kernels of :mod:`hps_service.cache.cpu_kernels` and the
device kernels of :mod:`hps_service.cache.cuda_kernels` do the same work (the tests hold them to it).

Semantics every path follows exactly:

* ``query`` draws one tick (only once its read is validated) and touches each hit: LRU sets the slot
  clock to the tick (its low 31 bits), LFU adds one per occurrence (up to ``LFU_CAP``). ``insert`` draws one
  tick too.
* Rows carry versions, and a row is never replaced by an older one. ``insert`` (keys deduplicated: the
  highest version, the last among equals, batch order kept): a cached key whose version is not newer
  than the offered one gets its row and version overwritten and is touched; a newer cached row is kept
  (counted as stale). Then per set, the new keys in batch order take the slots ordered by (free first,
  then ``layout.scores`` ascending at the insert's tick, then way ascending). The first ``ways`` new keys of a set are placed, the rest
  are dropped; an occupied slot taken is an eviction. With ``evict=False`` only free slots are taken. A
  new slot's clock is the tick (LRU) or 1 (LFU).
* ``update`` overwrites, in batch order, rows of cached keys whose version is not newer than the
  update's, without touching clocks; ``invalidate`` frees the slots of cached keys (with versions: only
  rows not newer than the delete's version).
* Counters kept by the writers in ``meta``: rows held and evictions, so statistics never scan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from hps_client.buffers import check_out
from hps_service.cache import cpu_kernels
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
    Allocator,
    CacheArrays,
    numpy_zeros,
    scores,
)
from hps_service.errors import InvalidArgumentError
from hps_service.jit.bound import bind_kernel
from hps_service.jit.hashing import mix64_array
from hps_service.jit.views import read_only_view
from hps_service.shm.counters import HitCounts

_INT64 = np.dtype(np.int64)

_S32 = np.uint64(32)
#: Sets are addressed with 32 hash bits (multiply-shift range reduction), so at most 2**32 of them.
MAX_SETS = 1 << 32
#: Lock-free attempts of a query before it waits for the writer (see SetAssocTableCache.lookup).
READ_ATTEMPTS = 3

Policy = Literal["lru", "lfu"]


def mix(keys: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer of each key's 64 bits (uint64)."""
    return mix64_array(keys.astype(np.int64, copy=False).view(np.uint64))


def set_index(keys: np.ndarray, sets: int) -> np.ndarray:
    """Set of each key: the high 32 bits of its hash, scaled to ``[0, sets)`` (multiply-shift, no division)."""
    return (((mix(keys) >> _S32) * np.uint64(sets)) >> _S32).astype(np.int64)


def tag_of(keys: np.ndarray) -> np.ndarray:
    """Slot tag of each key: ``0x80 | (hash & 0x7F)``, never 0 (the free-slot state)."""
    return (np.uint64(TAG_BIT) | (mix(keys) & np.uint64(TAG_HASH_MASK))).astype(np.uint8)


def latest_per_key(keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """Indices keeping one entry per key, the highest version (the last among equals), in batch order."""
    order = np.lexsort((np.arange(keys.shape[0]), versions, keys))
    sorted_keys = keys[order]
    last = np.ones(order.shape[0], dtype=bool)
    last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
    return np.sort(order[last])


def versions_arg(versions: np.ndarray | int, n: int) -> np.ndarray:
    """Per-row versions as a contiguous int64 array of ``n`` (a scalar applies to every row)."""
    arr = np.asarray(versions)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"versions must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.ndim == 0:
        return np.full(n, int(arr), dtype=np.int64)
    if arr.shape != (n,):
        raise InvalidArgumentError(f"versions must be a scalar or have shape ({n},), got {arr.shape}")
    return np.ascontiguousarray(arr)


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What an insert did: rows written (new + overwritten), new rows placed, rows evicted, new keys dropped,
    cached rows kept because they were newer than the offered ones."""

    written: int
    placed: int
    evicted: int
    dropped: int
    stale: int = 0


def check_geometry(capacity_rows: int, dim: int, ways: int, policy: str) -> int:
    """Validate a cache's shape; returns its number of sets."""
    if ways < 1:
        raise InvalidArgumentError(f"cache ways must be >= 1, got {ways}")
    if capacity_rows < 1:
        raise InvalidArgumentError(f"cache capacity must be >= 1 row, got {capacity_rows}")
    if capacity_rows % ways:
        raise InvalidArgumentError(f"cache capacity {capacity_rows} is not a whole number of {ways}-way sets")
    if capacity_rows // ways > MAX_SETS:
        raise InvalidArgumentError(f"cache of {capacity_rows} rows needs more than {MAX_SETS} sets; raise ways")
    if dim < 1:
        raise InvalidArgumentError(f"cache dim must be >= 1, got {dim}")
    if policy not in ("lru", "lfu"):
        raise InvalidArgumentError(f"cache policy must be 'lru' or 'lfu', not {policy!r}")
    return capacity_rows // ways


class SetAssociativeCache:
    """Fixed-capacity key -> (version, float32 row) cache with LRU or LFU eviction inside each set.

    Queries may run concurrently with each other and with one writer (:meth:`query_once` reports a read a
    writer overlapped); writers must be serialised by the caller
    (:class:`hps_service.cache.table_cache.SetAssocTableCache` does, with the sequence lock in ``meta``).
    ``compiled`` picks the numba kernels; False runs the NumPy reference.
    """

    backend = "numpy"

    def __init__(
        self,
        capacity_rows: int,
        dim: int,
        ways: int = 32,
        policy: Policy = "lru",
        compiled: bool = True,
        alloc: Allocator = numpy_zeros,
        arrays: CacheArrays | None = None,
    ) -> None:
        sets = check_geometry(capacity_rows, dim, ways, policy)
        if arrays is None:
            arrays = CacheArrays.allocate(sets, ways, dim, alloc)
        elif (arrays.sets, arrays.ways, arrays.dim) != (sets, ways, dim):
            raise InvalidArgumentError(
                f"cache arrays hold {arrays.sets}x{arrays.ways} slots of dim {arrays.dim}, not {sets}x{ways} of {dim}")
        self.arrays = arrays
        #: In host memory, which other processes of a node may map (a device cache has None here).
        self.mappable_arrays: CacheArrays | None = arrays
        self.dim = int(dim)
        self.ways = int(ways)
        self.sets = sets
        self.capacity = capacity_rows
        self.policy: Policy = policy
        self.compiled = compiled
        self.counts = HitCounts()
        self._lfu = policy == "lfu"
        self._keys_u64 = arrays.keys.view(np.uint64)
        self._bound_query: dict[bool, Callable[[np.ndarray, np.ndarray, np.ndarray], int]] = {}

    def finish_reads_under(self, exclusive: Callable[[], AbstractContextManager[Any]]) -> None:
        """Nothing to do: a read here retries until it sees no writer (the device cache's finishes under a lock)."""
        return None

    # ------------------------------------------------------------------ views
    @property
    def tags(self) -> np.ndarray:
        tags: np.ndarray = self.arrays.tags
        return tags

    @property
    def keys(self) -> np.ndarray:
        keys: np.ndarray = self.arrays.keys
        return keys

    @property
    def versions(self) -> np.ndarray:
        versions: np.ndarray = self.arrays.versions
        return versions

    @property
    def clock(self) -> np.ndarray:
        clock: np.ndarray = self.arrays.clock
        return clock

    @property
    def values(self) -> np.ndarray:
        values: np.ndarray = self.arrays.values
        return values

    @property
    def meta(self) -> np.ndarray:
        meta: np.ndarray = self.arrays.meta
        return meta

    @property
    def tick(self) -> int:
        return int(self.arrays.meta[META_TICK])

    @property
    def evictions(self) -> int:
        return int(self.arrays.meta[META_EVICTIONS])

    # ------------------------------------------------------------------ validation
    def _check_keys(self, keys: np.ndarray) -> np.ndarray:
        if not isinstance(keys, np.ndarray) or keys.ndim != 1:
            raise InvalidArgumentError("cache keys must be a 1-D NumPy array")
        if keys.dtype != np.int64:
            if keys.dtype.kind not in "iu":
                raise InvalidArgumentError(f"cache keys must be integers, got dtype {keys.dtype}")
            keys = keys.astype(np.int64)
        return np.ascontiguousarray(keys)

    def _check_rows(self, keys: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        if not isinstance(vectors, np.ndarray) or vectors.shape != (keys.shape[0], self.dim):
            shape = getattr(vectors, "shape", None)
            raise InvalidArgumentError(f"vectors must have shape ({keys.shape[0]}, {self.dim}), got {shape}")
        return np.ascontiguousarray(vectors, dtype=np.float32)

    # ------------------------------------------------------------------ probe (reference)
    def _probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(set, tag, way, present) per key; way is meaningless where not present."""
        sets = set_index(keys, self.sets)
        tags = tag_of(keys)
        match = (self.tags[sets] == tags[:, None]) & (self.keys[sets] == keys[:, None])
        present = match.any(axis=1)
        way = match.argmax(axis=1).astype(np.int64)
        return sets, tags, way, present

    def _draw_tick(self) -> int:
        if self.compiled:
            return int(cpu_kernels.next_tick(self.meta))
        self.meta[META_TICK] += 1
        return int(self.meta[META_TICK])

    # ------------------------------------------------------------------ query
    def query_once(self, keys: np.ndarray, out: np.ndarray, hit: np.ndarray, touch: bool = True) -> int:
        """One lock-free attempt: copy cached rows into ``out`` and set ``hit``; returns the number of hits, or -1
        when a writer overlapped the read (then ``out`` and ``hit`` are garbage and nothing was touched).

        Arguments must already be right, as the compiled query trusts them: C-contiguous int64 keys, writable
        C-contiguous float32 ``out`` of ``(n, dim)``, C-contiguous bool ``hit``.
        ``touch=False`` leaves clocks and the tick alone (a reader that maps the cache read-only).
        """
        if self.compiled:
            nhit: int = (self._bound_query.get(touch) or self.bound_query(touch))(keys, out, hit)
            return nhit
        seq = int(self.meta[META_SEQ])
        if seq & 1:
            return -1
        sets, _, way, present = self._probe(keys)
        hs, hw = sets[present], way[present]
        out[present] = self.values[hs * self.ways + hw]
        hit[:] = present
        if int(self.meta[META_SEQ]) != seq:
            return -1
        if touch:
            self._touch(hs, hw, self._draw_tick(), unique=False)
        return int(np.count_nonzero(present))

    def bound_query(self, touch: bool) -> Callable[[np.ndarray, np.ndarray, np.ndarray], int]:
        """The compiled :meth:`query_once` as one C call, ``query(keys, out, hit) -> hits or -1``, with no Python frame
        and no type dispatch: for a caller whose arguments are checked as :meth:`query_once` asks."""
        query = self._bound_query.get(touch)
        if query is None:
            # what the query only reads as read-only views: the owner's writable arrays and a worker's read-only
            # mapping of them then share one compiled specialisation (see jit/views.py)
            fixed = (read_only_view(self.tags), read_only_view(self._keys_u64), self.clock, read_only_view(self.values),
                     self.meta, self.sets, self._lfu, touch)
            sample = (np.empty(0, np.int64), np.empty((0, self.dim), np.float32), np.empty(0, np.bool_))
            query = self._bound_query[touch] = bind_kernel(cpu_kernels.query_kernel, fixed, sample)
        return query

    def query(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy the cached row of ``keys[i]`` into ``out[i]`` where cached; return the bool hit mask.

        Rows of ``out`` for misses are left as they were. Retries while a writer overlaps (single-writer use
        with concurrent readers is :class:`SetAssocTableCache`'s job).
        """
        keys = self._check_keys(keys)
        check_out(out, keys.shape[0], self.dim)
        hit = np.empty(keys.shape[0], dtype=np.bool_)
        nhit = self.query_once(keys, out, hit)
        while nhit < 0:
            nhit = self.query_once(keys, out, hit)
        self.counts.add(nhit, keys.shape[0] - nhit)
        return hit

    def _touch(self, sets: np.ndarray, ways: np.ndarray, tick: int, unique: bool) -> None:
        """Record one access per entry (duplicates count once each for LFU)."""
        if sets.shape[0] == 0:
            return
        if not self._lfu:
            self.clock[sets, ways] = tick & CLOCK_MASK
            return
        flat = sets * self.ways + ways
        counts: np.ndarray | int
        if unique:
            counted, counts = flat, 1
        else:
            counted, counts = np.unique(flat, return_counts=True)
        clock = self.clock.reshape(-1)
        clock[counted] = np.minimum(clock[counted].astype(np.int64) + counts, LFU_CAP)

    # ------------------------------------------------------------------ insert
    def insert(self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int = 0,
               evict: bool = True) -> InsertResult:
        """Insert rows with their versions (see the module docstring for placement, versions and eviction)."""
        keys = self._check_keys(keys)
        vectors = self._check_rows(keys, vectors)
        row_versions = versions_arg(versions, keys.shape[0])
        if keys.shape[0] == 0:
            self._draw_tick()
            return InsertResult(0, 0, 0, 0, 0)
        keep = cpu_kernels.latest_per_key(keys, row_versions) if self.compiled else latest_per_key(keys, row_versions)
        if keep.shape[0] != keys.shape[0]:
            keys, vectors, row_versions = keys[keep], vectors[keep], row_versions[keep]
        if self.compiled:
            return InsertResult(*(int(v) for v in cpu_kernels.insert(
                self.arrays, keys, vectors, row_versions, self._lfu, evict)))
        return self._insert_reference(keys, vectors, row_versions, evict)

    def _insert_reference(self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray,
                          evict: bool) -> InsertResult:
        ways = self.ways
        tick = self._draw_tick()
        sets, tags, way, present = self._probe(keys)
        cached = np.flatnonzero(present)
        fresh = self.versions[sets[cached], way[cached]] <= versions[cached]
        stale = int(np.count_nonzero(~fresh))
        cached = cached[fresh]
        ps, pw = sets[cached], way[cached]
        self.values[ps * ways + pw] = vectors[cached]
        self.versions[ps, pw] = versions[cached]
        self._touch(ps, pw, tick, unique=True)
        overwritten = int(cached.shape[0])

        new = np.flatnonzero(~present)
        m = int(new.shape[0])
        if m == 0:
            return InsertResult(overwritten, 0, 0, 0, stale)
        new_sets = sets[new]
        # Group the new keys by set, keeping batch order inside a group.
        order = np.argsort(new_sets * m + np.arange(m, dtype=np.int64))
        new, new_sets = new[order], new_sets[order]
        first = np.ones(m, dtype=bool)
        first[1:] = new_sets[1:] != new_sets[:-1]
        group = np.cumsum(first) - 1
        starts = np.flatnonzero(first)
        rank = np.arange(m, dtype=np.int64) - starts[group]
        group_sets = new_sets[first]
        # Per touched set: the slots in the order new keys take them.
        free = self.tags[group_sets] == 0
        hot = scores(self.clock[group_sets], tick, self._lfu)
        priority = np.where(free, FREE_SCORE, hot) * ways + np.arange(ways, dtype=np.int64)
        slot_order = np.argsort(priority, axis=1)
        fits = rank < ways
        g, idx = group[fits], new[fits]
        target_way = slot_order[g, rank[fits]]
        occupied = ~free[g, target_way]
        if not evict:
            g, idx, target_way, occupied = g[~occupied], idx[~occupied], target_way[~occupied], occupied[~occupied]
        target_set = group_sets[g]
        self.tags[target_set, target_way] = tags[idx]
        self.keys[target_set, target_way] = keys[idx]
        self.versions[target_set, target_way] = versions[idx]
        self.clock[target_set, target_way] = tick & CLOCK_MASK if not self._lfu else 1
        self.values[target_set * ways + target_way] = vectors[idx]
        placed = int(idx.shape[0])
        evicted = int(occupied.sum())
        self.meta[META_ROWS] += placed - evicted
        self.meta[META_EVICTIONS] += evicted
        return InsertResult(overwritten + placed, placed, evicted, m - placed, stale)

    # ------------------------------------------------------------------ update / invalidate
    def update(self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int = 0) -> int:
        """Overwrite rows of cached keys whose version is not newer, in batch order; returns distinct keys written."""
        keys = self._check_keys(keys)
        vectors = self._check_rows(keys, vectors)
        row_versions = versions_arg(versions, keys.shape[0])
        if keys.shape[0] == 0:
            return 0
        if self.compiled:
            return int(cpu_kernels.update(self.arrays, keys, vectors, row_versions))
        keep = latest_per_key(keys, row_versions)
        keys, vectors, row_versions = keys[keep], vectors[keep], row_versions[keep]
        sets, _, way, present = self._probe(keys)
        cached = np.flatnonzero(present)
        cached = cached[self.versions[sets[cached], way[cached]] <= row_versions[cached]]
        ps, pw = sets[cached], way[cached]
        self.values[ps * self.ways + pw] = vectors[cached]
        self.versions[ps, pw] = row_versions[cached]
        return int(cached.shape[0])

    def invalidate(self, keys: np.ndarray, versions: np.ndarray | int | None = None) -> int:
        """Free the slots of cached keys (with ``versions``: only rows not newer than the delete); returns how
        many slots were freed."""
        keys = self._check_keys(keys)
        row_versions = versions_arg(versions, keys.shape[0]) if versions is not None else None
        if keys.shape[0] == 0:
            return 0
        if self.compiled:
            return int(cpu_kernels.invalidate(self.arrays, keys, row_versions))
        if row_versions is not None:
            keep = latest_per_key(keys, row_versions)
            keys, row_versions = keys[keep], row_versions[keep]
        else:
            keys = np.unique(keys)
        sets, _, way, present = self._probe(keys)
        cached = np.flatnonzero(present)
        if row_versions is not None:
            cached = cached[self.versions[sets[cached], way[cached]] <= row_versions[cached]]
        ps, pw = sets[cached], way[cached]
        self.tags[ps, pw] = 0
        self.clock[ps, pw] = 0
        self.meta[META_ROWS] -= cached.shape[0]
        return int(cached.shape[0])

    # ------------------------------------------------------------------ bulk views
    def dump(self, start_slot: int = 0, stop_slot: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keys, a copy of the rows and the versions of the occupied slots in ``[start_slot, stop_slot)``."""
        stop = self.capacity if stop_slot is None else min(int(stop_slot), self.capacity)
        start = max(0, int(start_slot))
        occupied = np.flatnonzero(self.tags.reshape(-1)[start:stop])
        return (self.keys.reshape(-1)[start:stop][occupied].copy(), self.values[start + occupied],
                self.versions.reshape(-1)[start:stop][occupied].copy())

    def hottest_keys(self) -> np.ndarray:
        """Cached keys, hottest first (LRU: most recent access; LFU: most accesses)."""
        occupied = np.flatnonzero(self.tags.reshape(-1))
        hot = scores(self.clock.reshape(-1)[occupied], int(self.meta[META_TICK]), self._lfu)
        order = np.argsort(-hot, kind="stable")
        return self.keys.reshape(-1)[occupied[order]].copy()

    def clear(self) -> None:
        """Drop every row (counters other than rows stay)."""
        self.tags.fill(0)
        self.clock.fill(0)
        self.meta[META_ROWS] = 0

    def rows(self) -> int:
        """Occupied slots, from the writers' counter (no scan)."""
        return int(self.meta[META_ROWS])

    def memory_bytes(self) -> int:
        """Bytes of the cache's arrays."""
        return self.arrays.nbytes

    def stats(self) -> dict[str, float | str]:
        """hits, misses, hit_rate, rows, occupancy, capacity, evictions, backend, memory_bytes (counters only)."""
        rows = self.rows()
        hits, misses = self.counts.totals()
        total = hits + misses
        return {
            "hits": int(hits),
            "misses": int(misses),
            "hit_rate": hits / total if total else 0.0,
            "rows": int(rows),
            "occupancy": rows / self.capacity,
            "capacity": int(self.capacity),
            "evictions": int(self.evictions),
            "backend": self.backend,
            "memory_bytes": int(self.memory_bytes()),
        }


@functools.cache
def warm_up_kernels() -> None:
    """Compile (or load from numba's cache) every CPU kernel of the cache on a private scratch cache, so the
    first lookup after start runs compiled code: the query, insert, update, invalidate, dedup and seqlock."""
    from hps_service.cache.seqlock import SeqLock

    for policy in ("lru", "lfu"):
        cache = SetAssociativeCache(8, 1, ways=8, policy=policy)
        keys = np.array([1, 2, 2], dtype=np.int64)
        with SeqLock(cache.meta).write():
            cache.insert(keys, np.ones((3, 1), np.float32), np.array([1, 2, 3]))
            cache.update(keys, np.ones((3, 1), np.float32), 4)
        cache.query(keys, np.empty((3, 1), np.float32))
        cache.invalidate(keys[:1], 5)
        cache.invalidate(keys[1:])
