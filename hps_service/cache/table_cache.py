"""The L1 cache of one table as the lookup engine sees it (:class:`protocol.TableCache`).

Wraps a :class:`SetAssociativeCache` (host memory) or a :class:`DeviceCache` (GPU) with a sequence lock
(lookups take no lock and are rerun when a mutation overlapped them, so a reader never keeps a half-written
row) and decides which fetched rows enter and where they are inserted: inline when the batch hit rate is below ``hit_rate_threshold``,
else by a background worker through a bounded queue. Once the cache is full, only keys that have
missed ``admit_after_misses`` times lately enter (:mod:`admission`), grouped into one insert per
``GROUP_ROWS`` rows. It also refreshes cached rows from the lower tiers in strides, warm-starts from
a hotness snapshot (or the first rows of the table) and saves that snapshot on close.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps_client.buffers import check_out
from hps_service.cache.admission import MissSketch
from hps_service.cache.change_log import ChangeLog
from hps_service.cache.layout import CacheArrays
from hps_service.cache.protocol import FetchBelow, HostShare
from hps_service.cache.seqlock import SeqLock
from hps_service.cache.set_assoc import READ_ATTEMPTS, InsertResult, SetAssociativeCache, versions_arg
from hps_service.errors import InvalidArgumentError

log = logging.getLogger(__name__)

#: Rows fetched and inserted per step of warm start.
WARM_CHUNK_ROWS = 65536
#: Most rows the background worker coalesces into one insert.
DEFERRED_MAX_ROWS = 65536
#: Once the cache is full and admission filters by miss frequency, the few rows a request admits are grouped
#: and inserted (inline, or queued for the worker) when the group reaches this size: one insert or queue item
#: every ten or so requests instead of a fixed ~70 us insert call, or a queue hand-off, in each.
GROUP_ROWS = 256
#: A group older than this is inserted with the next admission whatever its size, so a slow trickle of misses
#: still reaches the cache.
GROUP_MAX_AGE_S = 1.0

#: (keys, rows, versions, change generation when read)
Offer = tuple[np.ndarray, np.ndarray, np.ndarray, int]

WarmKeys = Callable[[int], np.ndarray]
_INT64 = np.dtype(np.int64)


class SetAssocTableCache:
    """Thread-safe L1 cache of one table with deferred admission, refresh and warm start."""

    def __init__(
        self,
        cache: SetAssociativeCache | Any,
        fetch_below: FetchBelow,
        *,
        hit_rate_threshold: float = 0.9,
        refresh_interval_s: float = 0.0,
        refresh_fraction: float = 0.1,
        warm_keys: WarmKeys | None = None,
        snapshot_path: Path | None = None,
        warm_start: bool = True,
        queue_batches: int = 64,
        admit_after_misses: int = 1,
    ) -> None:
        if not 0.0 <= hit_rate_threshold <= 1.0:
            raise InvalidArgumentError(f"hit_rate_threshold must be in [0, 1], got {hit_rate_threshold}")
        if refresh_interval_s < 0:
            raise InvalidArgumentError(f"refresh_interval_s must be >= 0, got {refresh_interval_s}")
        if not 0.0 < refresh_fraction <= 1.0:
            raise InvalidArgumentError(f"refresh_fraction must be in (0, 1], got {refresh_fraction}")
        self._cache = cache
        self.dim = cache.dim
        self.capacity = cache.capacity
        self._fetch_below = fetch_below
        self._threshold = hit_rate_threshold
        self._refresh_interval_s = refresh_interval_s
        self._refresh_stride = max(1, math.ceil(refresh_fraction * cache.capacity))
        self._refresh_cursor = 0
        self._snapshot_path = snapshot_path
        self._lock = SeqLock(cache.meta)
        cache.finish_reads_under(self._lock.exclusive)
        self._changes = ChangeLog()
        self._counter_lock = threading.Lock()
        self._queued_rows = 0
        self._counts = {"admitted_inline": 0, "admitted_deferred": 0, "offers_dropped": 0,
                        "admission_refused": 0, "refreshed_rows": 0, "warm_rows": 0}
        self._sketch = MissSketch(cache.capacity, admit_after_misses) if admit_after_misses > 1 else None
        # While no insert has had to evict or drop a row there is room for everything: admit all.
        self._filling = True
        self._stop = threading.Event()
        self._closed = False
        self._queue: queue.Queue[list[Offer] | None] = queue.Queue(maxsize=queue_batches)
        self._group: list[Offer] = []
        self._group_rows = 0
        self._group_started = 0.0
        self._group_lock = threading.Lock()
        self._worker = threading.Thread(target=self._admit_worker, name="l1-admit", daemon=True)
        self._worker.start()
        self._refresher: threading.Thread | None = None
        if refresh_interval_s > 0:
            self._refresher = threading.Thread(target=self._refresh_loop, name="l1-refresh", daemon=True)
            self._refresher.start()
        self._warm_done = threading.Event()
        self._warmer: threading.Thread | None = None
        if warm_start and (warm_keys is not None or (snapshot_path is not None and snapshot_path.is_file())):
            self._warmer = threading.Thread(target=self._warm, args=(warm_keys,), name="l1-warm", daemon=True)
            self._warmer.start()
        else:
            self._warm_done.set()

    # ------------------------------------------------------------------ arrays in and out
    def _keys_arg(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys)
        if keys.ndim != 1 or keys.dtype.kind not in "iu":
            raise InvalidArgumentError(f"keys must be a 1-D integer array, got {keys.dtype} of shape {keys.shape}")
        return np.ascontiguousarray(keys, dtype=np.int64)

    def _rows_arg(self, keys: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        vectors = np.asarray(vectors)
        if vectors.shape != (keys.shape[0], self.dim):
            raise InvalidArgumentError(f"vectors must have shape ({keys.shape[0]}, {self.dim}), got {vectors.shape}")
        return np.ascontiguousarray(vectors, dtype=np.float32)

    # ------------------------------------------------------------------ protocol
    def lookup(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy cached rows of ``keys`` into ``out[i]`` where hit; return the (n,) bool hit mask (rows of misses
        are unspecified). Takes no lock: a read a writer overlapped is rerun, after a few tries while holding
        the writers' mutex (so it waits for the writer instead of spinning)."""
        if not (type(keys) is np.ndarray and keys.dtype is _INT64 and keys.ndim == 1 and keys.flags.c_contiguous):
            keys = self._keys_arg(keys)
        n = keys.shape[0]
        check_out(out, n, self.dim)
        hit = np.empty(n, dtype=np.bool_)
        cache = self._cache
        for _ in range(READ_ATTEMPTS):
            nhit = cache.query_once(keys, out, hit)
            if nhit >= 0:
                break
        else:
            with self._lock.exclusive():
                nhit = cache.query_once(keys, out, hit)
        cache.counts.add(nhit, n - nhit)
        return hit

    def generation(self) -> int:
        """Change generation to pass as ``fetched_at`` to :meth:`admit` when read before fetching below."""
        return self._changes.generation

    @property
    def arrays(self) -> CacheArrays | None:
        """The cache's arrays, as its allocator placed them in host memory; None for a device cache."""
        mappable: CacheArrays | None = self._cache.mappable_arrays
        return mappable

    def host_share(self) -> HostShare | None:
        """The arrays and the generation a node's workers read, when the arrays are in host memory."""
        arrays = self.arrays
        return HostShare(arrays, self.publish_generation_to) if arrays is not None else None

    def publish_generation_to(self, array: np.ndarray, index: int) -> None:
        """Keep ``array[index]`` at the change generation, for readers in other processes (never ahead of it)."""
        self._changes.mirror_to(array, index)

    def admit(
        self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, batch_hit_rate: float, *,
        fetched_at: int | None = None,
    ) -> None:
        """Offer rows fetched from lower tiers with their versions: inserted now when ``batch_hit_rate`` is below the threshold,
        else queued for the background worker (dropped and counted when the queue is full). Once the cache
        is full, keys not missed often enough are refused and the rest wait in a group of ``GROUP_ROWS``.

        ``fetched_at`` (from :meth:`generation`, read before the fetch) lets rows that an update or delete
        overtook be left out; without it only changes after this call are guarded against. A cached row newer
        than the offered one is kept.
        """
        keys = self._keys_arg(keys)
        vectors = self._rows_arg(keys, vectors)
        versions = versions_arg(versions, keys.shape[0])
        if keys.shape[0] == 0:
            return
        generation = self._changes.generation if fetched_at is None else fetched_at
        if self._closed:
            self._count("offers_dropped", 1)
            return
        if self._sketch is not None:
            admitted = self._sketch.admit(keys)
            if not self._filling and not admitted.all():
                self._count("admission_refused", keys.shape[0] - int(np.count_nonzero(admitted)))
                keys, vectors, versions = keys[admitted], vectors[admitted], versions[admitted]
                if keys.shape[0] == 0:
                    return
        grouping = self._sketch is not None and not self._filling
        if batch_hit_rate < self._threshold and not grouping:
            self._count("admitted_inline", self._insert_offers([(keys, vectors, versions, generation)]))
            return
        offers: list[Offer] = [(keys.copy(), vectors.copy(), versions.copy(), generation)]
        if grouping:
            grouped = self._add_to_group(offers[0])
            if grouped is None:
                return
            offers = grouped
        if batch_hit_rate < self._threshold:
            self._count("admitted_inline", self._insert_offers(offers))
            return
        rows = sum(o[0].shape[0] for o in offers)
        with self._counter_lock:
            self._queued_rows += rows
        try:
            self._queue.put_nowait(offers)
        except queue.Full:
            with self._counter_lock:
                self._queued_rows -= rows
                self._counts["offers_dropped"] += len(offers)

    def update(self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> None:
        """Online update: overwrite rows of keys that are cached and not newer than the update's versions."""
        keys = self._keys_arg(keys)
        vectors = self._rows_arg(keys, vectors)
        versions = versions_arg(versions, keys.shape[0])
        with self._lock.exclusive():
            self._changes.record(keys)  # the change log is the writers' alone: lock-free readers carry on meanwhile
            with self._lock.changing():
                self._cache.update(keys, vectors, versions)

    def invalidate(self, keys: np.ndarray, versions: np.ndarray | None = None) -> None:
        """Deletes: with ``versions``, drop cached rows not newer than the delete's; with None, drop the keys."""
        keys = self._keys_arg(keys)
        if versions is not None:
            versions = versions_arg(versions, keys.shape[0])
        with self._lock.exclusive():
            self._changes.record(keys)
            with self._lock.changing():
                self._cache.invalidate(keys, versions)

    def clear(self) -> None:
        """Drop everything, including offers still queued."""
        with self._group_lock:
            self._group, self._group_rows = [], 0
        with self._lock.write():
            self._changes.record_all()
            self._cache.clear()
            self._filling = True
        if self._sketch is not None:
            self._sketch.reset()

    def stats(self) -> dict[str, float | str]:
        """hits, misses, hit_rate, rows, occupancy, capacity, evictions, backend, memory_bytes and the
        admission/refresh/warm-start counters; ``queued_rows``: rows waiting for deferred insertion. All from
        counters: a scrape takes no cache lock and scans nothing."""
        base = self._cache.stats()
        with self._counter_lock:
            counts = dict(self._counts)
            queued = self._queued_rows
        with self._group_lock:
            queued += self._group_rows
        base.update({k: int(v) for k, v in counts.items()})
        base["queued_rows"] = int(queued)
        return base

    def close(self) -> None:
        """Stop the worker, refresh and warm-start threads; save the hotness snapshot."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._queue.put(None)
        for thread in (self._worker, self._refresher, self._warmer):
            if thread is not None:
                thread.join()
        if self._snapshot_path is not None:
            self._save_snapshot(self._snapshot_path)

    # ------------------------------------------------------------------ extras for tests and admin
    def flush(self) -> None:
        """Block until every offer queued or grouped so far has been inserted or discarded."""
        self._queue.join()
        with self._group_lock:
            group, self._group, self._group_rows = self._group, [], 0
        if group:
            self._count("admitted_inline", self._insert_offers(group))

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until warm start has finished; False on timeout."""
        return self._warm_done.wait(timeout)

    def hottest_keys(self) -> np.ndarray:
        """Cached keys, hottest first (what the snapshot holds)."""
        with self._lock.exclusive():
            return self._cache.hottest_keys()

    # ------------------------------------------------------------------ internals
    def _count(self, name: str, amount: int) -> None:
        with self._counter_lock:
            self._counts[name] += amount

    def _inserted(self, result: InsertResult) -> int:
        """Note whether the cache ran out of room (admission filtering starts then); returns rows written."""
        if result.evicted or result.dropped:
            self._filling = False
        return result.written

    def _admit_worker(self) -> None:
        while True:
            items = [self._queue.get()]
            rows = sum(o[0].shape[0] for o in items[0] or [])
            while items[-1] is not None and rows < DEFERRED_MAX_ROWS:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                rows += sum(o[0].shape[0] for o in items[-1] or [])
            offers = [o for item in items if item is not None for o in item]
            try:
                self._count("admitted_deferred", self._insert_offers(offers))
            except Exception:
                log.exception("deferred L1 insert failed; %d offers discarded", len(offers))
            finally:
                with self._counter_lock:
                    self._queued_rows -= sum(o[0].shape[0] for o in offers)
                for _ in items:
                    self._queue.task_done()
            if items[-1] is None:
                return

    def _add_to_group(self, offer: Offer) -> list[Offer] | None:
        """Add an offer to the group; returns the whole group (now emptied) once it is big or old enough."""
        now = time.monotonic()
        with self._group_lock:
            if not self._group:
                self._group_started = now
            self._group.append(offer)
            self._group_rows += offer[0].shape[0]
            if self._group_rows < GROUP_ROWS and now - self._group_started < GROUP_MAX_AGE_S:
                return None
            group, self._group, self._group_rows = self._group, [], 0
            return group

    def _insert_offers(self, batch: list[Offer], evict: bool = True) -> int:
        """Insert offers in one go, each without the keys changed since it was read; returns rows written."""
        if not batch:
            return 0
        # Writers are held off while the offers are checked against the change log; readers only during the insert.
        with self._lock.exclusive():
            kept_keys, kept_rows, kept_versions = [], [], []
            for keys, vectors, versions, generation in batch:
                changed = self._changes.changed_since(generation, keys)
                if changed is None:
                    continue
                if changed.any():
                    keys, vectors, versions = keys[~changed], vectors[~changed], versions[~changed]
                kept_keys.append(keys)
                kept_rows.append(vectors)
                kept_versions.append(versions)
            if not kept_keys:
                return 0
            if len(kept_keys) > 1:
                keys, vectors = np.concatenate(kept_keys), np.concatenate(kept_rows)
                versions = np.concatenate(kept_versions)
            else:
                keys, vectors, versions = kept_keys[0], kept_rows[0], kept_versions[0]
            if keys.shape[0] == 0:
                return 0
            with self._lock.changing():
                return self._inserted(self._cache.insert(keys, vectors, versions, evict=evict))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self._refresh_interval_s):
            try:
                self.refresh_once()
            except Exception:
                log.exception("L1 refresh stride failed; retrying next interval")

    def refresh_once(self) -> int:
        """Re-read the next stride of cached rows from the lower tiers; returns rows refreshed."""
        with self._lock.exclusive():
            generation = self._changes.generation
            start = self._refresh_cursor
            keys = self._cache.dump(start, start + self._refresh_stride)[0]
        self._refresh_cursor = 0 if start + self._refresh_stride >= self.capacity else start + self._refresh_stride
        if keys.shape[0] == 0:
            return 0
        rows, versions, stored = self._fetched(keys)
        with self._lock.exclusive():
            changed = self._changes.changed_since(generation, keys)
            if changed is None:
                return 0
            keep = ~changed & stored
            # Version-aware: a row updated meanwhile (newer than what was read) is kept.
            with self._lock.changing():
                refreshed = self._cache.update(keys[keep], rows[keep], versions[keep])
        self._count("refreshed_rows", refreshed)
        return refreshed

    def _warm(self, warm_keys: WarmKeys | None) -> None:
        try:
            keys = self._load_snapshot()
            if keys is None and warm_keys is not None:
                keys = self._keys_arg(warm_keys(self.capacity))
            if keys is None:
                return
            keys = keys[: self.capacity]
            for start in range(0, keys.shape[0], WARM_CHUNK_ROWS):
                if self._stop.is_set():
                    return
                chunk = keys[start : start + WARM_CHUNK_ROWS]
                generation = self._changes.generation
                rows, versions, stored = self._fetched(chunk)
                offer = (chunk[stored], rows[stored], versions[stored], generation)
                self._count("warm_rows", self._insert_offers([offer], evict=False))
        except Exception:
            log.exception("L1 warm start failed; the cache starts cold")
        finally:
            self._warm_done.set()

    def _fetched(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows, versions and the stored mask of ``keys`` from the tiers below, checked."""
        rows, versions, stored = self._fetch_below(keys)
        stored = np.asarray(stored, dtype=bool)
        if stored.shape != keys.shape:
            raise InvalidArgumentError(f"fetch_below returned a stored mask of shape {stored.shape} for {keys.shape}")
        return self._rows_arg(keys, rows), versions_arg(versions, keys.shape[0]), stored

    def _load_snapshot(self) -> np.ndarray | None:
        path = self._snapshot_path
        if path is None or not path.is_file():
            return None
        try:
            keys: np.ndarray = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            log.warning("L1 snapshot %s unreadable (%s); warming from the table instead", path, exc)
            return None
        if keys.ndim != 1 or keys.dtype != np.int64:
            log.warning("L1 snapshot %s holds %s %s, not 1-D int64 keys; ignored", path, keys.dtype, keys.shape)
            return None
        return keys

    def _save_snapshot(self, path: Path) -> None:
        keys = self.hottest_keys()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, keys, allow_pickle=False)
        os.replace(tmp, path)
