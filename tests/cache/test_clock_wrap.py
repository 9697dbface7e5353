"""The L1's four-byte clocks: LRU order across the 31-bit tick wrap, LFU counts that stop at the cap, and the
compiled and reference paths still equal there."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.cache.layout import CLOCK_MASK, LFU_CAP, META_TICK, scores
from hps_service.cache.set_assoc import SetAssociativeCache

#: Ticks a cache starts at: 0, just before the clocks' 31 bits wrap, just before 32 bits would, far beyond.
STARTS = [0, (1 << 31) - 6, (1 << 32) - 6, (1 << 45) - 6]


def _cache(policy: str, compiled: bool, start: int, sets: int = 1, ways: int = 8) -> SetAssociativeCache:
    cache = SetAssociativeCache(sets * ways, 2, ways=ways, policy=policy, compiled=compiled)
    cache.meta[META_TICK] = start
    return cache


def _rows(keys: np.ndarray) -> np.ndarray:
    return np.repeat(keys.astype(np.float32)[:, None], 2, axis=1)


def test_scores_read_clocks_back_against_the_tick() -> None:
    tick = (1 << 31) + 3  # clocks written 10 ticks ago (before the wrap), 2 ago, and 1 ahead (a later reader)
    clock = np.array([(tick - 10) & CLOCK_MASK, (tick - 2) & CLOCK_MASK, (tick + 1) & CLOCK_MASK], np.int32)
    np.testing.assert_array_equal(scores(clock, tick, lfu=False), [-10, -2, 1])
    np.testing.assert_array_equal(scores(clock, tick, lfu=True), clock.astype(np.int64))


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("compiled", [True, False])
def test_lru_evicts_the_least_recent_across_the_wrap(start: int, compiled: bool) -> None:
    cache = _cache("lru", compiled, start)
    keys = np.arange(8, dtype=np.int64)
    for k in keys:  # one tick each: the eight clocks straddle the wrap
        cache.insert(keys[k : k + 1], _rows(keys[k : k + 1]), 1)
    out = np.zeros((3, 2), np.float32)
    assert cache.query(keys[[0, 1, 2]], out).all()  # the oldest three, now the newest
    new = np.arange(100, 103, dtype=np.int64)
    result = cache.insert(new, _rows(new), 1)
    assert result.evicted == 3
    held = set(cache.dump()[0].tolist())
    assert held == {0, 1, 2, 6, 7, 100, 101, 102}  # 3, 4 and 5 were the least recently used


@pytest.mark.parametrize("compiled", [True, False])
def test_lfu_counts_stop_at_the_cap(compiled: bool) -> None:
    cache = _cache("lfu", compiled, 0, ways=2)
    keys = np.array([1, 2], np.int64)
    cache.insert(keys, _rows(keys), 1)
    flat = cache.clock.reshape(-1)
    flat[:] = LFU_CAP - 1
    out = np.zeros((4, 2), np.float32)
    assert cache.query(np.array([1, 1, 1, 2], np.int64), out).all()
    assert (cache.clock == LFU_CAP).all()  # never past it, so never negative
    cache.insert(np.array([3], np.int64), _rows(np.array([3], np.int64)), 1)
    assert cache.stats()["evictions"] == 1


@pytest.mark.parametrize("start", STARTS[1:])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_compiled_and_reference_stay_equal_across_the_wrap(start: int, policy: str) -> None:
    rng = np.random.default_rng(start % 1000)
    a, b = _cache(policy, True, start, sets=8, ways=8), _cache(policy, False, start, sets=8, ways=8)
    for step in range(60):
        keys = rng.integers(-150, 150, size=40).astype(np.int64)
        rows = rng.random((40, 2), dtype=np.float32)
        versions = rng.integers(0, 3, size=40)
        if step % 3 == 2:
            oa, ob = np.zeros((40, 2), np.float32), np.zeros((40, 2), np.float32)
            assert np.array_equal(a.query(keys, oa), b.query(keys, ob)) and np.array_equal(oa, ob)
        else:
            assert a.insert(keys, rows, versions) == b.insert(keys, rows, versions)
        for name in ("tags", "clock", "meta"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.stats() == b.stats() and a.stats()["evictions"] > 0
    np.testing.assert_array_equal(a.hottest_keys(), b.hottest_keys())
