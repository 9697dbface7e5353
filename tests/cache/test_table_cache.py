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
        self.reads = 0

    def fetch(self, keys: np.ndarray) -> np.ndarray:
        self.reads += len(keys)
        return self.rows[keys]


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
    cache.admit(keys, tier.fetch(keys), batch_hit_rate=0.0)
    hit, out = lookup(cache, keys)
    assert hit.all() and np.array_equal(out, tier.rows[keys])
    stats = cache.stats()
    assert stats["admitted_inline"] == 40 and stats["hits"] == 40 and stats["misses"] == 40
    assert stats["hit_rate"] == 0.5 and stats["rows"] == 40


def test_high_hit_rate_admits_off_the_request_path(cache: SetAssocTableCache, tier: LowerTier) -> None:
    keys = np.arange(200, 230, dtype=np.int64)
    admitted = threading.Event()
    with cache._lock.write():  # while a writer holds the cache, an inline insert could not proceed
        t = threading.Thread(target=lambda: (cache.admit(keys, tier.fetch(keys), 0.99), admitted.set()))
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
                cache.admit(keys, tier.fetch(keys), 1.0)
        assert cache.stats()["offers_dropped"] >= 3
        cache.flush()
        assert 1 <= cache.stats()["admitted_deferred"] // 10 <= 2
    finally:
        cache.close()


def test_update_overwrites_cached_rows_only(cache: SetAssocTableCache, tier: LowerTier) -> None:
    cached = np.arange(10, dtype=np.int64)
    cache.admit(cached, tier.fetch(cached), 0.0)
    keys = np.array([3, 4, 3000], dtype=np.int64)
    new = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
    cache.update(keys, new)
    hit, out = lookup(cache, keys)
    assert hit.tolist() == [True, True, False]
    assert np.array_equal(out[:2], new[:2])


def test_invalidate_and_clear(cache: SetAssocTableCache, tier: LowerTier) -> None:
    keys = np.arange(20, dtype=np.int64)
    cache.admit(keys, tier.fetch(keys), 0.0)
    cache.invalidate(keys[:5])
    hit, _ = lookup(cache, keys)
    assert hit.tolist() == [False] * 5 + [True] * 15
    cache.clear()
    assert not lookup(cache, keys)[0].any() and cache.stats()["rows"] == 0


def test_rows_read_before_an_update_are_not_admitted_after_it(cache: SetAssocTableCache, tier: LowerTier) -> None:
    keys = np.array([42, 43], dtype=np.int64)
    before = cache.generation()
    stale = tier.fetch(keys).copy()
    cache.update(keys[:1], np.ones((1, DIM), np.float32))  # not cached: nothing to overwrite
    cache.admit(keys, stale, 0.0, fetched_at=before)
    assert lookup(cache, keys)[0].tolist() == [False, True]
    # Deferred offers are checked against changes made while they wait in the queue.
    with cache._lock.write():
        cache.admit(np.array([44], dtype=np.int64), tier.fetch(np.array([44])), 0.99)
        cache._changes.record(np.array([44], dtype=np.int64))
    cache.flush()
    assert not lookup(cache, np.array([44], dtype=np.int64))[0].any()


def test_refresh_picks_up_changed_rows(tier: LowerTier) -> None:
    cache = make(tier, refresh_interval_s=0.0, refresh_fraction=0.5)
    try:
        keys = np.arange(64, dtype=np.int64)
        cache.admit(keys, tier.fetch(keys), 0.0)
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
        cache.admit(keys, tier.fetch(keys), 0.0)
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
    first.admit(hot, tier.fetch(hot), 0.0)
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
    cache = SetAssocTableCache(SetAssociativeCache(256, dim, ways=8), lambda k: np.zeros((len(k), dim), np.float32))
    keys = np.arange(200, dtype=np.int64)
    cache.admit(keys, np.zeros((200, dim), np.float32), 0.0)
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
                cache.update(keys, rows)
            elif version % 3 == 1:
                cache.invalidate(keys[version % 7 :: 7])
                cache.admit(keys, rows, 0.0)
            else:
                cache.admit(keys, rows, 1.0)

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
        cache.admit(np.arange(2), np.zeros((2, DIM + 1), np.float32), 0.0)
    with pytest.raises(InvalidArgumentError):
        SetAssocTableCache(SetAssociativeCache(8, DIM, ways=4), lambda k: k, hit_rate_threshold=1.5)


def test_device_read_path_answers_like_the_host_path(tier: LowerTier) -> None:
    """The CuPy read path (lookups under the writer mutex, hits copied back) runs here on NumPy arrays."""
    host = make(tier, hit_rate_threshold=1.0)  # every admission inline
    device = make(tier, hit_rate_threshold=1.0)
    device._on_host = False  # what a CuPy-backed cache sets; the array module stays NumPy here
    try:
        cached = np.arange(0, 300, 3, dtype=np.int64)
        for c in (host, device):
            c.admit(cached, tier.fetch(cached), 0.0)
        keys = np.arange(0, 200, dtype=np.int64)
        (host_hit, host_out), (dev_hit, dev_out) = lookup(host, keys), lookup(device, keys)
        assert np.array_equal(host_hit, dev_hit) and host_hit.sum() == 67
        assert np.array_equal(host_out[host_hit], dev_out[dev_hit])
        assert np.isnan(dev_out[~dev_hit]).all()  # rows of misses are left as they were
        assert device.stats()["hits"] == 67 and device.stats()["misses"] == 133
    finally:
        host.close()
        device.close()
