"""The thread-safe table cache: admission inline and deferred, updates, refresh, warm start, torn rows."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hps_service.cache import SetAssociativeCache, SetAssocTableCache, TableCache
from hps_service.errors import InvalidArgumentError

DIM = 8
ROWS = 4096
WAIT_S = 20.0  # liveness bound for background work, not a speed assertion
pytestmark = pytest.mark.timeout(120)


class LowerTier:
    """A table in host memory standing in for L2/L3: the true rows, which the test can change."""

    def __init__(self, rows: int = ROWS, dim: int = DIM) -> None:
        self.rows = np.random.default_rng(7).random((rows, dim), dtype=np.float32)
        self.versions = np.ones(rows, dtype=np.int64)
        self.reads = 0

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.reads += len(keys)
        return self.rows[keys], self.versions[keys], np.ones(len(keys), dtype=bool)

    def offer(self, cache: SetAssocTableCache, keys: np.ndarray, batch_hit_rate: float, **kwargs) -> None:
        rows, versions, _ = self.fetch(keys)
        cache.admit(keys, rows, versions, batch_hit_rate, **kwargs)


def make(tier: LowerTier, capacity: int = 512, ways: int = 8, **kwargs) -> SetAssocTableCache:
    return SetAssocTableCache(SetAssociativeCache(capacity, DIM, ways=ways), tier.fetch, **kwargs)


@pytest.fixture
def tier() -> LowerTier:
    return LowerTier()


@pytest.fixture
def cache(tier: LowerTier) -> Iterator[SetAssocTableCache]:
    c = make(tier, hit_rate_threshold=0.5)
    yield c
    c.close()


def lookup(cache: SetAssocTableCache, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = np.full((len(keys), DIM), np.nan, dtype=np.float32)
    return cache.lookup(keys, out), out


def wait_until(predicate, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_implements_the_protocol(cache: SetAssocTableCache) -> None:
    assert isinstance(cache, TableCache)
    assert cache.dim == DIM and cache.capacity == 512


def test_low_hit_rate_admits_inline(cache: SetAssocTableCache, tier: LowerTier) -> None:
    keys = np.arange(100, 140, dtype=np.int64)
    hit, _ = lookup(cache, keys)
    assert not hit.any()
    tier.offer(cache, keys, batch_hit_rate=0.0)
    hit, out = lookup(cache, keys)
    assert hit.all() and np.array_equal(out, tier.rows[keys])
    stats = cache.stats()
    assert stats["admitted_inline"] == 40 and stats["hits"] == 40 and stats["misses"] == 40
    assert stats["hit_rate"] == 0.5 and stats["rows"] == 40


def test_high_hit_rate_admits_off_the_request_path(cache: SetAssocTableCache, tier: LowerTier) -> None:
    keys = np.arange(200, 230, dtype=np.int64)
    admitted = threading.Event()
    with cache._lock.write():  # while a writer holds the cache, an inline insert could not proceed
        t = threading.Thread(target=lambda: (tier.offer(cache, keys, 0.99), admitted.set()))
        t.start()
        assert admitted.wait(WAIT_S), "admit with a high hit rate waited for the cache lock"
    t.join()
    cache.flush()
    hit, out = lookup(cache, keys)
    assert hit.all() and np.array_equal(out, tier.rows[keys])
    assert cache.stats()["admitted_deferred"] == 30 and cache.stats()["admitted_inline"] == 0


def test_full_admission_queue_drops_and_counts(tier: LowerTier) -> None:
    cache = make(tier, hit_rate_threshold=0.0, queue_batches=1)
    try:
        with cache._lock.write():
            for start in range(0, 50, 10):
                keys = np.arange(start, start + 10, dtype=np.int64)
                tier.offer(cache, keys, 1.0)
        assert cache.stats()["offers_dropped"] >= 3
        cache.flush()
        assert 1 <= cache.stats()["admitted_deferred"] // 10 <= 2
    finally:
        cache.close()


def test_update_overwrites_cached_rows_only(cache: SetAssocTableCache, tier: LowerTier) -> None:
    cached = np.arange(10, dtype=np.int64)
    tier.offer(cache, cached, 0.0)
    keys = np.array([3, 4, 3000], dtype=np.int64)
    new = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
    cache.update(keys, new, 2)
    hit, out = lookup(cache, keys)
    assert hit.tolist() == [True, True, False]
    assert np.array_equal(out[:2], new[:2])


def test_invalidate_and_clear(cache: SetAssocTableCache, tier: LowerTier) -> None:
    keys = np.arange(20, dtype=np.int64)
    tier.offer(cache, keys, 0.0)
    cache.invalidate(keys[:5])
    hit, _ = lookup(cache, keys)
    assert hit.tolist() == [False] * 5 + [True] * 15
    cache.clear()
    assert not lookup(cache, keys)[0].any() and cache.stats()["rows"] == 0


def test_rows_read_before_an_update_are_not_admitted_after_it(cache: SetAssocTableCache, tier: LowerTier) -> None:
    keys = np.array([42, 43], dtype=np.int64)
    before = cache.generation()
    stale, versions, _ = tier.fetch(keys)
    cache.update(keys[:1], np.ones((1, DIM), np.float32), 2)  # not cached: nothing to overwrite
    cache.admit(keys, stale, versions, 0.0, fetched_at=before)
    assert lookup(cache, keys)[0].tolist() == [False, True]
    # Deferred offers are checked against changes made while they wait in the queue.
    with cache._lock.write():
        tier.offer(cache, np.array([44], dtype=np.int64), 0.99)
        cache._changes.record(np.array([44], dtype=np.int64))
    cache.flush()
    assert not lookup(cache, np.array([44], dtype=np.int64))[0].any()


def test_refresh_picks_up_changed_rows(tier: LowerTier) -> None:
    cache = make(tier, refresh_interval_s=0.0, refresh_fraction=0.5)
    try:
        keys = np.arange(64, dtype=np.int64)
        tier.offer(cache, keys, 0.0)
        tier.rows[keys] += 1.0
        assert cache.refresh_once() + cache.refresh_once() == 64
        hit, out = lookup(cache, keys)
        assert hit.all() and np.array_equal(out, tier.rows[keys])
    finally:
        cache.close()


def test_refresh_thread_runs_on_its_interval(tier: LowerTier) -> None:
    cache = make(tier, refresh_interval_s=0.02, refresh_fraction=0.25)
    try:
        keys = np.arange(0, 300, 3, dtype=np.int64)
        tier.offer(cache, keys, 0.0)
        tier.rows[keys] = 5.0
        assert wait_until(lambda: np.array_equal(lookup(cache, keys)[1], tier.rows[keys]))
        assert cache.stats()["refreshed_rows"] >= len(keys)
    finally:
        cache.close()
    assert not any(t.is_alive() for t in (cache._worker, cache._refresher))


def test_warm_start_from_warm_keys(tier: LowerTier) -> None:
    asked: list[int] = []

    def first_rows(n: int) -> np.ndarray:
        asked.append(n)
        return np.arange(n, dtype=np.int64)

    cache = make(tier, warm_keys=first_rows)
    try:
        assert cache.wait_warm(WAIT_S)
        assert asked == [512]
        warm = cache.stats()["warm_rows"]
        assert warm == cache.stats()["rows"] and warm > 0.8 * 512
        hit, out = lookup(cache, np.arange(512, dtype=np.int64))
        assert hit.sum() == warm and np.array_equal(out[hit], tier.rows[:512][hit])
        assert cache.stats()["evictions"] == 0
    finally:
        cache.close()


def test_close_saves_hottest_keys_and_warm_start_loads_them(tier: LowerTier, tmp_path: Path) -> None:
    snapshot = tmp_path / "l1" / "item.npy"
    first = make(tier, snapshot_path=snapshot)
    hot = np.arange(1000, 1100, dtype=np.int64)
    tier.offer(first, hot, 0.0)
    lookup(first, hot[50:])
    first.close()
    saved = np.load(snapshot)
    assert sorted(saved.tolist()) == hot.tolist() and set(saved[:50].tolist()) == set(hot[50:].tolist())

    second = make(tier, snapshot_path=snapshot, warm_keys=lambda n: np.arange(n, dtype=np.int64))
    try:
        assert second.wait_warm(WAIT_S)
        hit, out = lookup(second, hot)
        assert hit.all() and np.array_equal(out, tier.rows[hot])
        assert second.stats()["rows"] == 100
    finally:
        second.close()


def test_unreadable_snapshot_falls_back_to_warm_keys(tier: LowerTier, tmp_path: Path) -> None:
    snapshot = tmp_path / "bad.npy"
    snapshot.write_bytes(b"not a numpy file")
    cache = make(tier, snapshot_path=snapshot, warm_keys=lambda n: np.arange(n, dtype=np.int64))
    try:
        assert cache.wait_warm(WAIT_S)
        assert cache.stats()["warm_rows"] > 0
    finally:
        cache.close()


def test_readers_never_see_torn_rows(tier: LowerTier) -> None:
    """Writers set whole rows to a version number; every hit a reader sees is one version throughout."""
    dim = 64
    cache = SetAssocTableCache(SetAssociativeCache(256, dim, ways=8), LowerTier(dim=dim).fetch)
    keys = np.arange(200, dtype=np.int64)
    cache.admit(keys, np.zeros((200, dim), np.float32), 0, 0.0)
    stop = threading.Event()
    torn: list[np.ndarray] = []
    hits = [0]

    def reader() -> None:
        out = np.empty((200, dim), np.float32)
        while not stop.is_set():
            hit = cache.lookup(keys, out)
            rows = out[hit]
            bad = rows.min(axis=1) != rows.max(axis=1)
            if bad.any():
                torn.append(rows[bad])
            hits[0] += int(hit.sum())

    def writer() -> None:
        for version in range(1, 400):
            rows = np.full((200, dim), version, dtype=np.float32)
            if version % 3 == 0:
                cache.update(keys, rows, version)
            elif version % 3 == 1:
                cache.invalidate(keys[version % 7 :: 7])
                cache.admit(keys, rows, version, 0.0)
            else:
                cache.admit(keys, rows, version, 1.0)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    writer()
    stop.set()
    for t in readers:
        t.join()
    cache.close()
    assert not torn, f"{len(torn)} lookups saw a half-written row"
    assert hits[0] > 0


def test_bad_arguments(cache: SetAssocTableCache) -> None:
    with pytest.raises(InvalidArgumentError):
        cache.lookup(np.zeros((2, 2), dtype=np.int64), np.zeros((2, DIM), np.float32))
    with pytest.raises(InvalidArgumentError):
        cache.lookup(np.arange(2), np.zeros((3, DIM), np.float32))
    with pytest.raises(InvalidArgumentError):
        cache.admit(np.arange(2), np.zeros((2, DIM + 1), np.float32), 0, 0.0)
    with pytest.raises(InvalidArgumentError):
        cache.update(np.arange(2), np.zeros((2, DIM), np.float32), np.zeros(3, np.int64))
    with pytest.raises(InvalidArgumentError):
        SetAssocTableCache(SetAssociativeCache(8, DIM, ways=4), lambda k: k, hit_rate_threshold=1.5)


def test_interleaved_writers_never_leave_an_older_row(cache: SetAssocTableCache, tier: LowerTier) -> None:
    """Defect 2 of issue 14: the consumer's update (v5) lands, then a slower REST put (v3) reaches L1: v5 stays."""
    key = np.array([7], dtype=np.int64)
    tier.offer(cache, key, 0.0)
    cache.update(key, np.full((1, DIM), 5.0, np.float32), np.array([5]))
    cache.update(key, np.full((1, DIM), 3.0, np.float32), np.array([3]))
    cache.admit(key, np.full((1, DIM), 4.0, np.float32), np.array([4]), 0.0)  # a promotion of an older read
    hit, out = lookup(cache, key)
    assert hit.all() and (out == 5.0).all()
    cache.invalidate(key, np.array([4]))  # a delete older than the cached row leaves it
    assert lookup(cache, key)[0].all()
    cache.invalidate(key, np.array([5]))
    assert not lookup(cache, key)[0].any()


def test_stats_take_no_lock_and_queued_rows_count_rows(cache: SetAssocTableCache, tier: LowerTier) -> None:
    """A scrape while a writer holds the cache answers at once, and the queue depth is in rows, not offers."""
    got: list[dict] = []
    with cache._lock.write():
        tier.offer(cache, np.arange(300, 340, dtype=np.int64), 0.99)  # one offer of 40 rows, queued
        t = threading.Thread(target=lambda: got.append(cache.stats()))
        t.start()
        t.join(WAIT_S)
        assert got, "stats waited for the writer"
        assert got[0]["queued_rows"] == 40
    cache.flush()
    assert cache.stats()["queued_rows"] == 0 and cache.stats()["rows"] == 40


def test_refresh_keeps_rows_newer_than_it_read(tier: LowerTier) -> None:
    cache = make(tier, refresh_fraction=1.0)
    try:
        keys = np.arange(8, dtype=np.int64)
        tier.offer(cache, keys, 0.0)
        cache.update(keys[:2], np.full((2, DIM), 9.0, np.float32), 7)  # newer than the tier's version 1
        assert cache.refresh_once() == 6
        hit, out = lookup(cache, keys)
        assert hit.all() and (out[:2] == 9.0).all() and np.array_equal(out[2:], tier.rows[keys[2:]])
    finally:
        cache.close()


def test_an_out_buffer_the_query_cannot_take_is_refused_by_name(cache: SetAssocTableCache, tier: LowerTier) -> None:
    """The compiled query is called with no type dispatch, so the checks before it are all that stands between a
    wrong buffer and memory: a read-only, strided, wrongly typed or shaped ``out`` is refused, and left as it was."""
    keys = np.arange(64, dtype=np.int64)
    tier.offer(cache, keys, batch_hit_rate=0.0)  # admitted inline: the reads below hit
    read_only = np.zeros((64, DIM), np.float32)
    read_only.flags.writeable = False
    for bad, why in ((read_only, "writable"), (np.zeros((DIM, 64), np.float32).T, "C-contiguous"),
                     (np.zeros((64, DIM), np.float64), "float32"), (np.zeros((63, DIM), np.float32), r"\(64, 8\)")):
        for query in (cache.lookup, cache._cache.query):
            with pytest.raises(InvalidArgumentError, match=why):
                query(keys, bad)
    assert not read_only.any()
    hit, out = lookup(cache, keys)
    assert hit.all()
    np.testing.assert_array_equal(out, tier.rows[keys])
