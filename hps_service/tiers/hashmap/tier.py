"""The in-process volatile tier: a bounded hash map of versioned rows per table, with LRU or LFU overflow.

Each table keeps dense row storage (vectors, keys, versions, one access stamp per row) for its whole capacity,
reserved at creation as zeroed memory the OS backs page by page as rows are first written: a table never copies
its rows to grow (a copy at 1M rows of dim 64 held the table's lock for 0.1-0.35 s and needed twice the memory
meanwhile). An open-addressing int32 index (see ``index``) grows by doubling as rows arrive. When a
put would exceed the capacity, the ``evict_fraction`` of rows with the oldest stamp (LRU: the table clock
at the last access) or the lowest access count (LFU) is removed in one vectorised step.

A versioned delete leaves a tombstone row (key and version, negative stamp; see ``rows``). It
takes a row slot until a newer put replaces it or eviction takes it (tombstones go first, oldest first), so
tombstones never grow beyond the capacity. ``count`` and ``stats().rows`` are live rows only.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np

from hps_service.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from hps_service.jit.views import read_only_view
from hps_service.keys import as_keys
from hps_service.shm.region import NamedAllocator, anonymous
from hps_service.tiers.base import (
    LaneRead,
    Rows,
    Tier,
    TierCapability,
    TierStats,
    check_positions,
    delete_versions,
    max_version_per_key,
)
from hps_service.tiers.hashmap import index as index_ops
from hps_service.tiers.hashmap import rows as row_ops
from hps_service.tiers.hashmap import seqlock
from hps_service.tiers.hashmap import stamps as stamps_ops
from hps_service.tiers.hashmap.complete import Completeness
from hps_service.tiers.hashmap.lane import Lane
from hps_service.tiers.hashmap.layout import CTRL, META, META_WORDS, PARTS, ROWS, index_name, part_name
from hps_service.tiers.hashmap.reader import TableArrays
from hps_service.tiers.hashmap.stamps import stamp_halves
from hps_service.tiers.placement import Release


def _no_release(_name: str) -> None:
    return None


def _no_remap() -> None:
    """The owner reads its own index, never an older generation of it."""

#: Rows a new table's index is sized for before it first doubles.
INITIAL_ROWS = 1024
#: The index has at least this many slots per allocated row (load factor at most 0.7 when full).
_INDEX_SLOTS_PER_ROW = 1.0 / 0.7


def _index_size(row_capacity: int) -> int:
    """The power-of-two index length for ``row_capacity`` rows."""
    return 1 << max(4, math.ceil(math.log2(row_capacity * _INDEX_SLOTS_PER_ROW)))


#: Bytes a held row takes besides its ``dim`` 4-byte words: key, version, and the owner's and readers' stamps.
_ROW_META_BYTES = 3 * 8


def rows_within(budget_bytes: int, dim: int) -> int:
    """The most rows of width ``dim`` (4-byte words) whose storage and full index fit in ``budget_bytes``."""
    per_row = 4 * dim + _ROW_META_BYTES
    lo, hi = 0, budget_bytes // per_row
    while lo < hi:  # the largest n with n * per_row + the index for n rows <= budget
        mid = (lo + hi + 1) // 2
        if mid * per_row + 4 * _index_size(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Table:
    """Storage, index and counters of one table; every access by this process holds ``lock``, every change is
    bracketed by the control array's sequence lock for readers in other processes (``reader.TableReader``)."""

    def __init__(self, name: str, dim: int, max_rows: int, alloc: NamedAllocator, release: Release) -> None:
        self.name = name
        self.dim = dim
        self.capacity = max_rows  # rows the table may hold, tombstones included
        self.lock = threading.RLock()
        self.n_rows = 0  # rows held, tombstones included
        self.rows_touched = 0  # the most rows ever held: storage pages in use
        self.n_tombstones = 0
        self.evictions = 0
        self._alloc = alloc
        self._release = release
        self.ctrl = alloc(part_name(name, CTRL), (seqlock.CTRL_LEN,), np.int64)
        self.complete = Completeness(self.ctrl)
        # Key, version and the two int32 stamps of a row share one cache line: a lookup misses once for all.
        self.meta = alloc(part_name(name, META), (max_rows, META_WORDS), np.int64)
        self.keys = self.meta[:, 0]
        self.versions = self.meta[:, 1]
        #: This process's stamps, and readers' in other processes (never written here except to move or reset them).
        self.stamps, self.reader_stamps = stamp_halves(self.meta)
        self.rows = alloc(part_name(name, ROWS), (max_rows, dim), np.float32)
        self.index_gen = 0
        self.index = self._new_index(_index_size(min(INITIAL_ROWS, max_rows)))
        self._index_view: tuple[np.ndarray, int] | None = None
        #: The compiled pass over the table (made at its first lookup).
        self.lane: Lane | None = None
        self.index.fill(index_ops.EMPTY)
        self._publish_index()
        #: Rows the index takes at a load of at most 0.7 (never more than the storage).
        self.row_capacity = self._index_room(0)

    def _new_index(self, size: int) -> np.ndarray:
        self.index_gen += 1
        return self._alloc(index_name(self.name, self.index_gen), (size,), np.int32)

    def read_index(self) -> tuple[np.ndarray, int]:
        """The index as the compiled pass reads it (a read-only view) and its generation (callers hold ``lock``)."""
        view = self._index_view
        if view is None or view[1] != self.index_gen:
            view = self._index_view = (read_only_view(self.index), self.index_gen)
        return view

    def _publish_index(self) -> None:
        """Point readers at the current index (callers hold the sequence lock or nobody reads yet)."""
        self.ctrl[seqlock.CTRL_INDEX_LEN] = self.index.shape[0]
        self.ctrl[seqlock.CTRL_INDEX_GEN] = self.index_gen

    @contextmanager
    def changing(self) -> Iterator[None]:
        """The sequence-lock write section around a change (callers hold ``lock``)."""
        seqlock.seq_begin(self.ctrl)
        try:
            yield
        finally:
            seqlock.seq_end(self.ctrl)

    def set_rows(self, n: int) -> None:
        """Record the rows held after a kernel added or removed some."""
        self.n_rows = n
        self.rows_touched = max(self.rows_touched, n)

    def memory_bytes(self) -> int:
        """Bytes in use: the storage pages rows have been written to, and the index."""
        per_row = self.meta.strides[0] + self.rows.strides[0]
        return int(self.rows_touched * per_row + self.index.nbytes)

    def reserve(self, needed_rows: int) -> None:
        """Make room for ``needed_rows`` rows (callers cap it at the capacity): double the index as needed. The new
        index is built aside (readers go on using the old one) and swapped in under the sequence lock; readers then
        map it by its generation."""
        if needed_rows <= self.row_capacity:
            return
        old_gen = self.index_gen
        index = self._new_index(_index_size(needed_rows))
        index_ops.rebuild_index(index, self.keys, np.int64(self.n_rows))
        with self.changing():
            self.index = index
            self._publish_index()
        self._release(index_name(self.name, old_gen))
        self.row_capacity = self._index_room(needed_rows)

    def _index_room(self, needed_rows: int) -> int:
        """Rows the current index takes at its load limit (at least ``needed_rows``), capped by the storage."""
        return min(int(self.keys.shape[0]), max(needed_rows, int(self.index.shape[0] / _INDEX_SLOTS_PER_ROW)))

    def tick(self) -> np.int64:
        """Advance the table clock (one tick per batch, shared with the readers' ticks) and return it."""
        return seqlock.tick(self.ctrl)

    def effective_stamps(self, n: int, lfu: bool) -> np.ndarray:
        """Eviction order (int64) of rows ``[0, n)``: this process's stamps combined with the readers' (LRU: the
        later access; LFU: the larger count); tombstones below every row, oldest first."""
        return stamps_ops.decode(self.stamps[:n], self.reader_stamps[:n], int(self.ctrl[seqlock.CTRL_CLOCK]), lfu)

    def drop(self) -> None:
        """Give the arrays back (files of a shared store are unlinked)."""
        for part in PARTS:
            self._release(part_name(self.name, part))
        self._release(index_name(self.name, self.index_gen))


class HashMapTier(Tier):
    """Bounded in-process tier; ``capacity_rows`` (and ``capacity_bytes``) apply to each table separately."""

    kind = "volatile"
    in_process = True
    capabilities = TierCapability.WRITES

    def __init__(
        self,
        capacity_rows: int,
        overflow_policy: Literal["lru", "lfu"] = "lru",
        evict_fraction: float = 0.1,
        allocator: NamedAllocator = anonymous,
        release: Release = _no_release,
        capacity_bytes: int | None = None,
    ) -> None:
        """``allocator`` places each table's arrays (private memory by default; files of a shared store for the
        node's worker processes, which read them with ``reader.TableReader``), ``release`` gives them back.
        ``capacity_bytes``: a memory budget per table, so that a table of narrower stored rows (fp16, int8) holds
        more of them; a table holds the fewer of ``capacity_rows`` and the rows that fit it."""
        if capacity_bytes is not None and capacity_bytes < 1:
            raise InvalidArgumentError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if (
            not isinstance(capacity_rows, (int, np.integer))
            or isinstance(capacity_rows, bool)
            or capacity_rows < 1
        ):
            raise InvalidArgumentError(f"capacity_rows must be a positive integer, got {capacity_rows!r}")
        if capacity_rows >= np.iinfo(np.int32).max:
            raise InvalidArgumentError(
                f"capacity_rows must be below 2**31-1 (int32 row ids), got {capacity_rows}"
            )
        if overflow_policy not in ("lru", "lfu"):
            raise InvalidArgumentError(f"overflow_policy must be 'lru' or 'lfu', got {overflow_policy!r}")
        if not 0.0 < evict_fraction <= 1.0:
            raise InvalidArgumentError(f"evict_fraction must be in (0, 1], got {evict_fraction!r}")
        self.capacity_rows = int(capacity_rows)
        self.capacity_bytes = capacity_bytes
        self.overflow_policy = overflow_policy
        self.evict_fraction = float(evict_fraction)
        self._lfu = overflow_policy == "lfu"
        self._alloc = allocator
        self._release = release
        self._tables: dict[str, _Table] = {}
        self._tables_lock = threading.Lock()

    def _table(self, table: str) -> _Table:
        try:
            return self._tables[table]
        except KeyError:
            raise NotFoundError(f"volatile hashmap tier has no table {table!r}") from None

    @staticmethod
    def _vectors(vectors: np.ndarray, n: int, dim: int) -> np.ndarray:
        arr = np.asarray(vectors)
        if arr.shape != (n, dim):
            raise InvalidArgumentError(f"vectors must have shape ({n}, {dim}) for {n} keys, got {arr.shape}")
        if arr.dtype.kind != "f":
            raise InvalidArgumentError(f"vectors must be float32, got dtype {arr.dtype}")
        return np.ascontiguousarray(arr, dtype=np.float32)

    @staticmethod
    def _versions(versions: np.ndarray, n: int) -> np.ndarray:
        arr = np.asarray(versions)
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentError(f"versions must be integers (int64), got dtype {arr.dtype}")
        if arr.ndim == 0:
            return np.full(n, int(arr), dtype=np.int64)
        if arr.shape != (n,):
            raise InvalidArgumentError(f"versions must have shape ({n},) for {n} keys, got {arr.shape}")
        return np.ascontiguousarray(arr, dtype=np.int64)

    def create_table(self, table: str, dim: int) -> None:
        """Make ``table`` ready for rows of width ``dim``; idempotent when the dim matches."""
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < 1:
            raise InvalidArgumentError(f"dim of table {table!r} must be a positive integer, got {dim!r}")
        with self._tables_lock:
            existing = self._tables.get(table)
            if existing is not None:
                if existing.dim != dim:
                    raise InvalidArgumentError(
                        f"table {table!r} exists with dim {existing.dim}, asked for dim {dim}"
                    )
                return
            rows = self.capacity_rows
            if self.capacity_bytes is not None:
                rows = min(rows, rows_within(self.capacity_bytes, int(dim)))
                if rows < 1:
                    raise InvalidArgumentError(f"volatile.capacity_mb ({self.capacity_bytes / 2**20:g} MiB) holds no "
                                               f"row of table {table!r} ({4 * int(dim)} B a row and its index)")
            try:
                self._tables[table] = _Table(table, int(dim), rows, self._alloc, self._release)
            except ResourceExhaustedError as exc:
                raise ResourceExhaustedError(
                    f"{exc}; lower volatile.capacity_rows (memory is only used as rows arrive, but this host refuses "
                    f"the reservation)") from None

    def get(self, table: str, keys: np.ndarray) -> Rows:
        """Look up ``keys``; hits get their access stamp refreshed (LRU clock or LFU count)."""
        t = self._table(table)
        query = read_only_view(as_keys(keys))  # the kernels get every key array read-only: one specialisation
        out = Rows(
            vectors=np.empty((query.size, t.dim), dtype=np.float32),
            versions=np.empty(query.size, dtype=np.int64),
            found=np.empty(query.size, dtype=bool),
        )
        with t.lock:
            row_ops.get_rows_at(
                t.index, t.keys, t.rows, t.versions, t.stamps, query, np.arange(query.size),
                out.vectors, out.versions, out.found, t.tick(), self._lfu,
            )  # fmt: skip
        return out

    def fill(self, table: str, keys: np.ndarray, positions: np.ndarray, out: np.ndarray, versions: np.ndarray,
             found: np.ndarray) -> int:
        """The rows of ``keys[positions]`` straight into ``out[positions]`` in one compiled pass, hits stamped as
        :meth:`get` stamps them (see :meth:`Tier.fill`)."""
        t = self._table(table)
        check_positions(keys, positions, out, t.dim)
        with t.lock:
            return int(row_ops.get_rows_at(t.index, t.keys, t.rows, t.versions, t.stamps, read_only_view(keys),
                                           positions, out, versions, found, t.tick(), self._lfu))

    def lane(self, table: str) -> LaneRead:
        """The compiled pass over ``table`` (:mod:`.lane`), run with its lock held: hits stamped as :meth:`get`
        stamps them, and whether the table is complete."""
        t = self._table(table)
        lane = t.lane
        if lane is None:
            lane = t.lane = Lane(t.ctrl, t.meta, t.rows, t.stamps, t.stamps, self._lfu, t.read_index, _no_remap)

        def read(keys: np.ndarray, out: np.ndarray, sources: np.ndarray, miss: np.ndarray) -> tuple[int, bool]:
            if self._tables.get(table) is not t:  # dropped since (a caller that kept the pass reads the table anew)
                raise NotFoundError(f"volatile hashmap tier has no table {table!r}")
            with t.lock:
                return lane.read(keys, out, sources, miss)

        return read

    def complete_token(self, table: str) -> int:
        t = self._table(table)
        with t.lock:
            return t.complete.token()

    def mark_complete(self, table: str, token: int) -> bool:
        t = self._table(table)
        with t.lock:
            return t.complete.mark(token)

    def is_complete(self, table: str) -> bool:
        return self._table(table).complete.held

    def lose_complete(self, table: str) -> None:
        t = self._table(table)
        with t.lock:
            t.complete.lose()

    def put(self, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Upsert rows unless the stored version is newer; evicts by policy when the table is full.

        Returns the mask of rows written. With duplicate keys in a batch, they apply in batch order.
        """
        t = self._table(table)
        query = read_only_view(as_keys(keys))
        vecs = read_only_view(self._vectors(vectors, query.size, t.dim))
        vers = read_only_view(self._versions(versions, query.size))
        written = np.zeros(query.size, dtype=bool)
        with t.lock:
            self._make_room(t, query)
            clock = t.tick()
            with t.changing():
                n, revived, full = row_ops.put_rows(
                    t.index, t.keys, t.rows, t.versions, t.stamps, t.reader_stamps, np.int64(t.n_rows),
                    np.int64(min(t.capacity, t.row_capacity)),
                    query, vecs, vers, written, clock, self._lfu,
                )  # fmt: skip
                if full:  # rows the persistent tier may store and this table does not hold
                    t.complete.lose(in_section=True)
            t.set_rows(int(n))
            t.n_tombstones -= int(revived)
        return written

    def _make_room(self, t: _Table, query: np.ndarray) -> None:
        """Evict and grow storage so that the keys of ``query`` not yet held fit (up to the capacity)."""
        present_rows = np.empty(query.size, dtype=np.int64)
        missing = int(index_ops.locate_rows(t.index, t.keys, read_only_view(query), present_rows))
        if t.n_rows + missing > t.capacity:
            self._evict(t, present_rows, t.n_rows + missing - t.capacity)
        t.reserve(min(t.capacity, t.n_rows + missing))

    def _evict(self, t: _Table, batch_rows: np.ndarray, overflow: int) -> None:
        """Remove at least ``overflow`` rows (normally ``evict_fraction`` of capacity), sparing the batch's rows."""
        n = t.n_rows
        spared = np.unique(batch_rows[batch_rows >= 0])
        evictable = n - spared.size
        count = min(evictable, max(overflow, math.ceil(self.evict_fraction * t.capacity)))
        if count <= 0:
            return
        stamps = t.effective_stamps(n, self._lfu)
        stamps[spared] = np.iinfo(np.int64).max
        if count < n:
            victims = np.argpartition(stamps, count - 1)[:count]
        else:
            victims = np.arange(n)
        victims = np.sort(victims)[::-1].copy()
        t.n_tombstones -= int(np.count_nonzero(t.stamps[victims] < 0))
        with t.changing():
            t.complete.lose(in_section=True)
            kept = row_ops.evict_rows(t.index, t.keys, t.rows, t.versions, t.stamps, t.reader_stamps, np.int64(n), victims)
        t.set_rows(int(kept))
        t.evictions += count

    def delete(self, table: str, keys: np.ndarray, versions: np.ndarray | None = None) -> int:
        """Remove ``keys`` (with ``versions``: rows not newer, leaving tombstones); returns live rows removed."""
        t = self._table(table)
        query = read_only_view(as_keys(keys))
        tomb_versions = delete_versions(versions, query.size)
        with t.lock:
            if tomb_versions is None:
                with t.changing():
                    n, removed, tombstones = row_ops.delete_keys(
                        t.index, t.keys, t.rows, t.versions, t.stamps, t.reader_stamps, np.int64(t.n_rows), query
                    )
                t.n_tombstones -= int(tombstones)
            else:
                query, tomb_versions = max_version_per_key(query, tomb_versions)
                self._make_room(t, query)
                clock = t.tick()
                with t.changing():
                    n, removed, added = row_ops.tombstone_keys(
                        t.index, t.keys, t.versions, t.stamps, t.reader_stamps, np.int64(t.n_rows),
                        np.int64(min(t.capacity, t.row_capacity)), query, tomb_versions, clock,
                    )  # fmt: skip
                t.n_tombstones += int(added)
            t.set_rows(int(n))
        return int(removed)

    def count(self, table: str) -> int:
        """Live rows held for ``table`` (tombstones excluded)."""
        t = self._table(table)
        with t.lock:
            return t.n_rows - t.n_tombstones

    def table_bytes(self, table: str) -> int:
        """Bytes held by every array of ``table``: vectors, keys, versions, stamps and index."""
        t = self._table(table)
        with t.lock:
            return t.memory_bytes()

    def stats(self, table: str) -> TierStats:
        """Live rows, capacity, evictions, tombstones and memory use per held row (rows and tombstones).

        ``bytes_per_row`` and ``memory_ratio`` divide by the held rows, tombstones included, since each takes
        a full row slot; ``capacity`` bounds the two together.
        """
        t = self._table(table)
        with t.lock:
            held, tombstones, memory, evictions = t.n_rows, t.n_tombstones, t.memory_bytes(), t.evictions
        raw_row_bytes = t.dim * 4
        extra: dict[str, float] = {"memory_bytes": int(memory), "raw_row_bytes": raw_row_bytes,
                                   "tombstones": int(tombstones), "complete": int(t.complete.held),
                                   "complete_lost": t.complete.lost}
        if held:
            extra["bytes_per_row"] = memory / held
            extra["memory_ratio"] = memory / (held * raw_row_bytes)
        return TierStats(
            rows=held - tombstones, capacity=t.capacity, evictions=evictions, extra=extra
        )

    def scan_keys(self, table: str, limit: int) -> np.ndarray:
        """Up to ``limit`` keys of live rows (tombstones skipped), in storage order."""
        if limit < 0:
            raise InvalidArgumentError(f"limit must be non-negative, got {limit}")
        t = self._table(table)
        with t.lock:
            if not t.n_tombstones:
                return t.keys[: min(limit, t.n_rows)].copy()
            live = t.stamps[: t.n_rows] >= 0
            return t.keys[: t.n_rows][live][:limit].copy()

    def drop_table(self, table: str) -> None:
        """Forget ``table`` and free its memory."""
        with self._tables_lock:
            t = self._tables.pop(table, None)
            if t is None:
                raise NotFoundError(f"volatile hashmap tier has no table {table!r}")
        t.drop()

    def table_arrays(self, table: str) -> TableArrays:
        """The arrays of ``table`` as a reader in another process maps them (see ``reader.TableReader``)."""
        t = self._table(table)
        return TableArrays(ctrl=t.ctrl, meta=t.meta, rows=t.rows, reader_stamps=t.reader_stamps, index=t.index,
                           index_gen=t.index_gen)

    def close(self) -> None:
        """Free every table."""
        with self._tables_lock:
            tables, self._tables = list(self._tables.values()), {}
        for t in tables:
            t.drop()

