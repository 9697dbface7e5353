"""Admission by miss frequency: once L1 is full, one-off keys of the tail stop evicting hotter rows."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.cache import SetAssociativeCache, SetAssocTableCache
from hps_service.cache.admission import MissSketch
from hps_service.cache.table_cache import GROUP_ROWS
from hps_service.errors import InvalidArgumentError

DIM = 4


def test_a_key_is_admitted_on_its_nth_miss() -> None:
    sketch = MissSketch(capacity_rows=4096, min_misses=3)
    keys = np.array([10, 20, 30], dtype=np.int64)
    assert sketch.admit(keys).tolist() == [False, False, False]
    assert sketch.admit(keys[:2]).tolist() == [False, False]
    assert sketch.admit(keys).tolist() == [True, True, False]


def test_counts_fade_after_a_window_of_misses() -> None:
    sketch = MissSketch(capacity_rows=1024, min_misses=2)
    key = np.array([7], dtype=np.int64)
    assert not sketch.admit(key)[0]
    # A window's worth of other misses halves every counter: the one old miss of key 7 is forgotten.
    others = np.arange(1000, 1000 + sketch.window, dtype=np.int64)
    for batch in np.split(others, 16):
        sketch.admit(batch)
    assert not sketch.admit(key)[0]
    assert sketch.admit(key)[0]


def test_a_batch_bigger_than_the_window_does_not_fade_its_own_counts() -> None:
    sketch = MissSketch(capacity_rows=1024, min_misses=2)
    big = np.arange(2 * sketch.window, dtype=np.int64)
    assert sketch.admit(big).mean() < 0.5  # first sight: only keys whose counters collided get in
    assert sketch.admit(big).all()  # second sight: every key (a halving in between would have stopped them)


def test_reset_forgets_everything() -> None:
    sketch = MissSketch(capacity_rows=1024, min_misses=2)
    key = np.array([5], dtype=np.int64)
    sketch.admit(key)
    sketch.reset()
    assert not sketch.admit(key)[0]


@pytest.mark.parametrize(("capacity", "min_misses"), [(0, 2), (16, 0), (16, 16)])
def test_bad_arguments(capacity: int, min_misses: int) -> None:
    with pytest.raises(InvalidArgumentError):
        MissSketch(capacity, min_misses)


def fetch_zeros(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros((len(keys), DIM), np.float32), np.zeros(len(keys), np.int64), np.ones(len(keys), bool)


def _table_cache(capacity: int, admit_after_misses: int) -> SetAssocTableCache:
    return SetAssocTableCache(
        SetAssociativeCache(capacity, DIM, ways=4), fetch_zeros,
        hit_rate_threshold=1.0, warm_start=False, admit_after_misses=admit_after_misses,
    )


def _offer(cache: SetAssocTableCache, keys: np.ndarray) -> None:
    cache.admit(keys, np.ones((keys.shape[0], DIM), np.float32), 0, batch_hit_rate=0.0)


def _cached(cache: SetAssocTableCache, keys: np.ndarray) -> np.ndarray:
    return cache.lookup(keys, np.empty((keys.shape[0], DIM), np.float32))


def test_everything_is_admitted_until_the_cache_runs_out_of_room() -> None:
    cache = _table_cache(capacity=4096, admit_after_misses=2)
    try:
        first = np.arange(16, dtype=np.int64)
        _offer(cache, first)
        assert _cached(cache, first).all() and cache.stats()["admission_refused"] == 0
        _offer(cache, np.arange(100, 4400, dtype=np.int64))  # overflows some sets: evictions switch the filter on
        assert cache.stats()["evictions"] > 0
        once = np.arange(10_000, 10_008, dtype=np.int64)
        _offer(cache, once)
        # the first miss of a key is refused (a key whose sketch counters all collided would slip through)
        assert cache.stats()["admission_refused"] >= 7
        _offer(cache, once)  # the second miss lets them in, grouped with other admissions for one insert
        assert not _cached(cache, once).any()
        cache.flush()
        assert _cached(cache, once).all()
        group = np.arange(20_000, 20_000 + GROUP_ROWS, dtype=np.int64)
        _offer(cache, group)
        _offer(cache, group)  # a full group is inserted by the request that completes it
        assert _cached(cache, group).all()
        cache.clear()  # an empty cache admits everything again
        later = np.arange(50_000, 50_008, dtype=np.int64)
        _offer(cache, later)
        assert _cached(cache, later).all()
    finally:
        cache.close()


def test_admission_raises_the_zipf_hit_rate_and_cuts_inserts() -> None:
    """The same zipf stream through two caches of 5% of the keys, misses offered inline as the engine does."""
    rng = np.random.default_rng(3)
    universe = 20_000
    stream = (rng.zipf(1.05, size=(400, 512)) - 1) % universe
    results = {}
    for admit_after in (1, 2):
        cache = _table_cache(capacity=1024, admit_after_misses=admit_after)
        try:
            hits = total = 0
            for batch in stream.astype(np.int64):
                uniq = np.unique(batch)
                hit = _cached(cache, uniq)
                if total >= 100 * 512:  # count once the cache has filled
                    hits += int(hit.sum())
                total += uniq.shape[0]
                _offer(cache, uniq[~hit])
            stats = cache.stats()
            results[admit_after] = (hits, stats["admitted_inline"])
        finally:
            cache.close()
    (hits_all, inserts_all), (hits_filtered, inserts_filtered) = results[1], results[2]
    assert hits_filtered > hits_all
    assert inserts_filtered < inserts_all / 2


def test_groups_of_high_hit_rate_batches_go_to_the_worker() -> None:
    cache = SetAssocTableCache(
        SetAssociativeCache(4096, DIM, ways=4), fetch_zeros,
        hit_rate_threshold=0.5, warm_start=False, admit_after_misses=2,
    )
    try:
        cache.admit(np.arange(100, 4400, dtype=np.int64), np.ones((4300, DIM), np.float32), 0,
                    batch_hit_rate=0.0)
        cache.admit(np.array([9_999], dtype=np.int64), np.ones((1, DIM), np.float32), 0, batch_hit_rate=0.99)
        assert cache.stats()["admission_refused"] == 1  # full: admissions are filtered and grouped from here on
        group = np.arange(20_000, 20_000 + GROUP_ROWS, dtype=np.int64)
        for _ in range(2):
            cache.admit(group, np.ones((GROUP_ROWS, DIM), np.float32), 0, batch_hit_rate=0.99)
        cache.flush()
        assert _cached(cache, group).all()
        assert cache.stats()["admitted_deferred"] == GROUP_ROWS
    finally:
        cache.close()


def test_a_small_group_is_inserted_once_it_is_old(monkeypatch: pytest.MonkeyPatch) -> None:
    import hps_service.cache.table_cache as table_cache_module

    monkeypatch.setattr(table_cache_module, "GROUP_MAX_AGE_S", 0.0)  # every group is already old enough
    cache = _table_cache(capacity=4096, admit_after_misses=2)
    try:
        _offer(cache, np.arange(100, 4400, dtype=np.int64))  # overflows some sets: the filter is on
        few = np.arange(30_000, 30_004, dtype=np.int64)
        _offer(cache, few)
        _offer(cache, few)
        assert _cached(cache, few).all()  # inserted without waiting for GROUP_ROWS rows or a flush()
    finally:
        cache.close()
