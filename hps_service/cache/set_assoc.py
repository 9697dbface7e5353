"""A set-associative embedding cache written once against an array module (NumPy or CuPy).

Layout: slot keys ``(sets, ways)`` int64 with :data:`EMPTY` for a free slot, a per-slot ``clock``
(LRU: the global tick of the last access; LFU: the access count) and values ``(sets*ways, dim)``
float32. A key lives only in set ``mix64(key) % sets``. The ``xp`` code below is the reference; on
NumPy the compiled kernels of :mod:`hps_service.cache.cpu_kernels` do the same work in one pass, and
on CuPy the probe of a query runs as the RawKernel of :mod:`hps_service.cache.cuda_kernels`.

Semantics every path follows exactly (the tests hold them to it):

* ``query`` and ``insert`` each advance the global tick by one; a hit (or an insert of a cached key)
  sets the slot clock to the tick (LRU) or adds one per occurrence (LFU).
* ``insert`` (keys deduplicated, last occurrence wins, batch order kept): cached keys get their vector
  overwritten and are touched; then per set, the new keys in batch order take the slots ordered by
  (empty first, then clock ascending, then way ascending). The first ``ways`` new keys of a set are
  placed, the rest are dropped; a non-empty slot taken is an eviction. With ``evict=False`` only empty
  slots are taken. A new slot's clock is the tick (LRU) or 1 (LFU).
* ``update`` overwrites vectors of cached keys (last occurrence wins) without touching clocks;
  ``invalidate`` frees the slots of cached keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from hps_service.cache.array_module import is_numpy, to_host
from hps_service.errors import InvalidArgumentError

_INT64 = np.dtype(np.int64)
_FLOAT32 = np.dtype(np.float32)
#: The slot key of a free slot; never a valid user key.
EMPTY = np.int64(np.iinfo(np.int64).min)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
#: Sets are addressed with 32 hash bits (multiply-shift range reduction), so at most 2**32 of them.
MAX_SETS = 1 << 32

Policy = Literal["lru", "lfu"]


def set_index(xp: ModuleType, keys: Any, sets: int) -> Any:
    """Set of each key: the high 32 bits of the splitmix64 finalizer of its bits, scaled to ``[0, sets)``.

    Multiply-shift instead of a modulo: the same uniform spread without a 64-bit division per key.
    """
    x = keys.astype(xp.int64, copy=False).view(xp.uint64)
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    x = x ^ (x >> _S31)
    return (((x >> _S32) * xp.uint64(sets)) >> _S32).astype(xp.int64)


def last_occurrence(xp: ModuleType, keys: Any) -> Any:
    """Indices of the last occurrence of each distinct key, in batch order."""
    n = keys.shape[0]
    if n < 2:
        return xp.arange(n, dtype=xp.int64)
    _, first_in_reversed = xp.unique(keys[::-1], return_index=True)
    return xp.sort(n - 1 - first_in_reversed.astype(xp.int64))


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What an insert did: rows written (new + overwritten), new rows placed, rows evicted, keys dropped."""

    written: int
    placed: int
    evicted: int
    dropped: int


class SetAssociativeCache:
    """Fixed-capacity key -> float32 row cache with LRU or LFU eviction inside each set.

    Not thread-safe: :class:`hps_service.cache.table_cache.SetAssocTableCache` adds the locking.
    ``compiled`` picks the numba (NumPy) or RawKernel (CuPy) fast paths; False runs the xp reference.
    """

    def __init__(
        self,
        capacity_rows: int,
        dim: int,
        ways: int = 32,
        policy: Policy = "lru",
        xp: ModuleType = np,
        compiled: bool = True,
    ) -> None:
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
        self.xp = xp
        self.dim = int(dim)
        self.ways = int(ways)
        self.sets = capacity_rows // ways
        self.capacity = capacity_rows
        self.policy: Policy = policy
        self.compiled = compiled
        self.keys = xp.full((self.sets, self.ways), EMPTY, dtype=xp.int64)
        self.clock = xp.zeros((self.sets, self.ways), dtype=xp.int64)
        self.values = xp.zeros((self.capacity, self.dim), dtype=xp.float32)
        self.tick = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._ways_range = xp.arange(self.ways, dtype=xp.int64)
        self._cpu = None
        self._cuda = None
        self._lfu = policy == "lfu"
        self._keys_u64 = self.keys.view(xp.uint64)
        if compiled and is_numpy(xp):
            from hps_service.cache import cpu_kernels

            self._cpu = cpu_kernels
            self._query_kernel = cpu_kernels.query_kernel
        elif compiled:
            from hps_service.cache.cuda_kernels import CudaProbe

            self._cuda = CudaProbe(xp)

    # ------------------------------------------------------------------ validation
    def _check_keys(self, keys: Any) -> Any:
        xp = self.xp
        if not isinstance(keys, xp.ndarray) or keys.ndim != 1:
            raise InvalidArgumentError("cache keys must be a 1-D array of the cache's array module")
        if keys.dtype != xp.int64:
            if keys.dtype.kind not in "iu":
                raise InvalidArgumentError(f"cache keys must be integers, got dtype {keys.dtype}")
            keys = keys.astype(xp.int64)
        return keys

    def _check_rows(self, keys: Any, vectors: Any) -> Any:
        xp = self.xp
        if not isinstance(vectors, xp.ndarray) or vectors.shape != (keys.shape[0], self.dim):
            shape = getattr(vectors, "shape", None)
            raise InvalidArgumentError(f"vectors must have shape ({keys.shape[0]}, {self.dim}), got {shape}")
        return xp.ascontiguousarray(vectors, dtype=xp.float32)

    def _reject_empty_key(self, keys: Any) -> None:
        if keys.shape[0] and int(keys.min()) == EMPTY:  # EMPTY is the smallest int64
            raise InvalidArgumentError(f"key {int(EMPTY)} is reserved as the cache's empty-slot marker")

    def _new_clock(self) -> int:
        return self.tick if self.policy == "lru" else 1

    # ------------------------------------------------------------------ probe (reference)
    def _probe(self, keys: Any) -> tuple[Any, Any, Any]:
        """(set, way, present) per key; way is meaningless where not present."""
        xp = self.xp
        sets = set_index(xp, keys, self.sets)
        match = self.keys[sets] == keys[:, None]
        present = match.any(axis=1)
        way = match.argmax(axis=1).astype(xp.int64)
        return sets, way, present

    # ------------------------------------------------------------------ query
    def query(self, keys: Any, out: Any) -> Any:
        """Copy the cached row of ``keys[i]`` into ``out[i]`` where cached; return the bool hit mask.

        Rows of ``out`` for misses are left as they were.
        """
        if (
            self._cpu is not None
            and type(keys) is np.ndarray
            and type(out) is np.ndarray
            and keys.dtype is _INT64
            and keys.ndim == 1
            and out.dtype is _FLOAT32
            and out.shape == (keys.shape[0], self.dim)
            and out.flags.c_contiguous
        ):
            # The hot path: arguments already right, straight into the compiled probe.
            self.tick += 1
            hit = np.empty(keys.shape[0], dtype=np.bool_)
            nhit = self._query_kernel(
                self._keys_u64, self.clock, self.values, keys.view(np.uint64), out, hit, self.sets, self.tick,
                self._lfu,
            )
            self.hits += nhit
            self.misses += keys.shape[0] - nhit
            return hit
        keys = self._check_keys(keys)
        if out.shape != (keys.shape[0], self.dim) or out.dtype != self.xp.float32:
            raise InvalidArgumentError(f"out must be float32 of shape ({keys.shape[0]}, {self.dim}), got {out.shape}")
        self.tick += 1
        n = keys.shape[0]
        if self._cpu is not None and out.flags.c_contiguous:
            hit = np.empty(n, dtype=np.bool_)
            nhit = self._cpu.query(
                self.keys, self.clock, self.values, keys, out, hit, self.sets, self.tick, self.policy == "lfu"
            )
        elif self._cuda is not None and out.flags.c_contiguous:
            hit = self._cuda.query(self.keys, self.clock, self.values, keys, out, self.tick, self.policy == "lfu")
            nhit = int(hit.sum())
        else:
            hit = self._query_reference(keys, out)
            nhit = int(hit.sum())
        self.hits += nhit
        self.misses += n - nhit
        return hit

    def _query_reference(self, keys: Any, out: Any) -> Any:
        sets, way, present = self._probe(keys)
        hs, hw = sets[present], way[present]
        out[present] = self.values[hs * self.ways + hw]
        self._touch(hs, hw, unique=False)
        return present

    def _touch(self, sets: Any, ways: Any, unique: bool) -> None:
        """Record one access per entry (duplicates count once each for LFU)."""
        xp = self.xp
        if sets.shape[0] == 0:
            return
        if self.policy == "lru":
            self.clock[sets, ways] = self.tick
            return
        flat = sets * self.ways + ways
        if unique:
            counted, counts = flat, 1
        else:
            counted, counts = xp.unique(flat, return_counts=True)
        clock_flat = self.clock.reshape(-1)
        clock_flat[counted] += counts

    # ------------------------------------------------------------------ insert
    def insert(self, keys: Any, vectors: Any, evict: bool = True) -> InsertResult:
        """Insert rows (see the module docstring for the exact placement and eviction rules)."""
        keys = self._check_keys(keys)
        vectors = self._check_rows(keys, vectors)
        self._reject_empty_key(keys)
        self.tick += 1
        if keys.shape[0] == 0:
            return InsertResult(0, 0, 0, 0)
        keep = self._cpu.last_occurrence(keys) if self._cpu is not None else last_occurrence(self.xp, keys)
        if keep.shape[0] != keys.shape[0]:
            keys, vectors = keys[keep], vectors[keep]
        if self._cpu is not None:
            written, placed, evicted, dropped = self._cpu.insert(
                self.keys, self.clock, self.values, keys, vectors, self.sets, self.tick,
                self.policy == "lfu", evict,
            )
            result = InsertResult(int(written), int(placed), int(evicted), int(dropped))
        else:
            result = self._insert_reference(keys, vectors, evict)
        self.evictions += result.evicted
        return result

    def _insert_reference(self, keys: Any, vectors: Any, evict: bool) -> InsertResult:
        xp = self.xp
        ways = self.ways
        sets, way, present = self._probe(keys)
        ps, pw = sets[present], way[present]
        self.values[ps * ways + pw] = vectors[present]
        self._touch(ps, pw, unique=True)
        overwritten = int(ps.shape[0])

        new = xp.nonzero(~present)[0]
        m = int(new.shape[0])
        if m == 0:
            return InsertResult(overwritten, 0, 0, 0)
        new_sets = sets[new]
        # Group the new keys by set, keeping batch order inside a group.
        order = xp.argsort(new_sets * m + xp.arange(m, dtype=xp.int64))
        new, new_sets = new[order], new_sets[order]
        first = xp.ones(m, dtype=bool)
        first[1:] = new_sets[1:] != new_sets[:-1]
        group = xp.cumsum(first) - 1
        starts = xp.nonzero(first)[0]
        rank = xp.arange(m, dtype=xp.int64) - starts[group]
        group_sets = new_sets[first]
        # Per touched set: the slots in the order new keys take them.
        gkeys = self.keys[group_sets]
        priority = xp.where(gkeys == EMPTY, -1, self.clock[group_sets]) * ways + self._ways_range
        slot_order = xp.argsort(priority, axis=1)
        fits = rank < ways
        g, r, idx = group[fits], rank[fits], new[fits]
        target_way = slot_order[g, r]
        occupied = gkeys[g, target_way] != EMPTY
        if not evict:
            g, idx, target_way, occupied = g[~occupied], idx[~occupied], target_way[~occupied], occupied[~occupied]
        target_set = group_sets[g]
        self.keys[target_set, target_way] = keys[idx]
        self.clock[target_set, target_way] = self._new_clock()
        self.values[target_set * ways + target_way] = vectors[idx]
        placed = int(idx.shape[0])
        evicted = int(occupied.sum())
        return InsertResult(overwritten + placed, placed, evicted, m - placed)

    # ------------------------------------------------------------------ update / invalidate
    def update(self, keys: Any, vectors: Any) -> int:
        """Overwrite the rows of cached keys (last occurrence wins); returns how many keys were cached."""
        keys = self._check_keys(keys)
        vectors = self._check_rows(keys, vectors)
        if keys.shape[0] == 0:
            return 0
        if self._cpu is not None:
            return int(self._cpu.update(self.keys, self.values, keys, vectors, self.sets))
        keep = last_occurrence(self.xp, keys)
        if keep.shape[0] != keys.shape[0]:
            keys, vectors = keys[keep], vectors[keep]
        sets, way, present = self._probe(keys)
        self.values[sets[present] * self.ways + way[present]] = vectors[present]
        return int(present.sum())

    def invalidate(self, keys: Any) -> int:
        """Free the slots of cached keys; returns how many distinct keys were cached."""
        keys = self._check_keys(keys)
        if keys.shape[0] == 0:
            return 0
        if self._cpu is not None:
            return int(self._cpu.invalidate(self.keys, self.clock, keys, self.sets))
        sets, way, present = self._probe(keys)
        ps, pw = sets[present], way[present]
        removed = int(self.xp.unique(ps * self.ways + pw).shape[0]) if ps.shape[0] else 0
        self.keys[ps, pw] = EMPTY
        self.clock[ps, pw] = 0
        return removed

    # ------------------------------------------------------------------ bulk views
    def dump(self, start_slot: int = 0, stop_slot: int | None = None) -> tuple[Any, Any]:
        """Keys and a copy of the vectors of the occupied slots in ``[start_slot, stop_slot)``."""
        stop = self.capacity if stop_slot is None else min(int(stop_slot), self.capacity)
        start = max(0, int(start_slot))
        flat_keys = self.keys.reshape(-1)[start:stop]
        occupied = self.xp.nonzero(flat_keys != EMPTY)[0]
        return flat_keys[occupied].copy(), self.values[start + occupied].copy()

    def hottest_keys(self) -> np.ndarray:
        """Cached keys, hottest first (LRU: most recent access; LFU: most accesses), on the host."""
        keys = to_host(self.keys).reshape(-1)
        clock = to_host(self.clock).reshape(-1)
        occupied = np.nonzero(keys != EMPTY)[0]
        order = np.argsort(-clock[occupied], kind="stable")
        return keys[occupied[order]].copy()

    def clear(self) -> None:
        """Drop every row (counters stay)."""
        self.keys.fill(EMPTY)
        self.clock.fill(0)

    def rows(self) -> int:
        """Occupied slots."""
        return int((self.keys != EMPTY).sum())

    def stats(self) -> dict[str, float]:
        """hits, misses, hit_rate, rows, occupancy, capacity, evictions."""
        rows = self.rows()
        total = self.hits + self.misses
        return {
            "hits": float(self.hits),
            "misses": float(self.misses),
            "hit_rate": self.hits / total if total else 0.0,
            "rows": float(rows),
            "occupancy": rows / self.capacity,
            "capacity": float(self.capacity),
            "evictions": float(self.evictions),
        }
