"""The hash map's four-byte access stamps: eviction order holds across the 31-bit clock wrap (tombstones across it:
``test_hashmap.test_tombstones_are_evicted_first_oldest_first``)."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.tiers.hashmap import seqlock
from hps_service.tiers.hashmap.reader import TableReader
from hps_service.tiers.hashmap.stamps import MASK, TOMBSTONE_BASE, counted, decode, live, tombstone
from hps_service.tiers.hashmap.tier import HashMapTier
from tests.tiers.test_hashmap import STAMP_WRAPS

TABLE = "demo.item"


def _rows(keys: np.ndarray, dim: int) -> np.ndarray:
    return (keys.astype(np.float32)[:, None] + np.arange(dim, dtype=np.float32))


def _tier(capacity: int, policy: str, fraction: float, clock: int) -> HashMapTier:
    tier = HashMapTier(capacity, overflow_policy=policy, evict_fraction=fraction)  # type: ignore[arg-type]
    tier.create_table(TABLE, 4)
    tier.table_arrays(TABLE).ctrl[seqlock.CTRL_CLOCK] = clock
    return tier


def test_stamp_encoding_is_four_bytes_with_the_sign_for_tombstones() -> None:
    for clock in (0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) + 5, (1 << 62) + 3):
        assert 0 <= live(np.int64(clock)) <= MASK
        assert tombstone(np.int64(clock)) < 0
    assert counted(np.int32(MASK)) == MASK  # LFU counts saturate instead of turning negative (a tombstone)
    assert counted(np.int32(6)) == 7
    now = (1 << 31) + 10  # rows stamped 20 ticks ago (before the wrap) and 5 ticks ago (after it)
    stamps = np.array([live(np.int64(now - 20)), live(np.int64(now - 5)), tombstone(np.int64(now - 30)),
                       tombstone(np.int64(now - 1))], np.int32)
    order = decode(stamps, np.zeros(4, np.int32), now, lfu=False)
    np.testing.assert_array_equal(order[:2], [now - 20, now - 5])
    np.testing.assert_array_equal(order[2:], [now - 30 - TOMBSTONE_BASE, now - 1 - TOMBSTONE_BASE])
    readers = np.array([live(np.int64(now - 2)), 0, live(np.int64(now)), 0], np.int32)
    np.testing.assert_array_equal(decode(stamps, readers, now, lfu=False)[:3],
                                  [now - 2, now - 5, now - 30 - TOMBSTONE_BASE])  # a tombstone stays one
    # a reader that drew a later tick than the clock the owner read: just touched, not 2**31 ticks old
    ahead = np.array([live(np.int64(now + 1))], np.int32)
    np.testing.assert_array_equal(decode(ahead, np.zeros(1, np.int32), now, lfu=False), [now + 1])
    np.testing.assert_array_equal(decode(np.zeros(1, np.int32), ahead, now, lfu=False), [now + 1])


@pytest.mark.parametrize("clock", STAMP_WRAPS)
def test_lru_eviction_keeps_recently_read_rows_across_the_wrap(clock: int) -> None:
    tier = _tier(1000, "lru", 0.2, clock)
    old = np.arange(1000, dtype=np.int64)
    for lo in range(0, 1000, 20):  # 50 ticks: the stamps of these rows straddle the wrap
        tier.put(TABLE, old[lo:lo + 20], _rows(old[lo:lo + 20], 4), np.ones(20, np.int64))
    hot = old[::5]
    assert tier.get(TABLE, hot).found.all()
    new = np.arange(10_000, 10_100, dtype=np.int64)
    assert tier.put(TABLE, new, _rows(new, 4), np.ones(100, np.int64)).all()
    assert tier.stats(TABLE).evictions == 200
    assert tier.get(TABLE, hot).found.all() and tier.get(TABLE, new).found.all()
    cold = np.setdiff1d(old, hot)
    kept = tier.get(TABLE, cold).found
    # the 200 cold rows written first went (12 whole batches of 16, 8 of the 13th), whatever side of the wrap
    assert kept.sum() == 600 and not kept[:192].any() and kept[208:].all()


@pytest.mark.parametrize("clock", STAMP_WRAPS)
def test_readers_stamps_count_across_the_wrap(clock: int) -> None:
    tier = _tier(1000, "lru", 0.2, clock)
    old = np.arange(1000, dtype=np.int64)
    for lo in range(0, 1000, 20):
        tier.put(TABLE, old[lo:lo + 20], _rows(old[lo:lo + 20], 4), np.ones(20, np.int64))
    arrays = tier.table_arrays(TABLE)
    reader = TableReader(arrays, lambda gen: arrays.index, lfu=False)  # another process's reads, by their stamps
    early = old[:200]  # the oldest puts, read since by the reader only
    assert reader.get(early).found.all()
    new = np.arange(10_000, 10_200, dtype=np.int64)
    assert tier.put(TABLE, new, _rows(new, 4), np.ones(200, np.int64)).all()
    assert tier.get(TABLE, early).found.all()
    assert not tier.get(TABLE, old[200:400]).found.any()


def test_a_row_takes_24_bytes_besides_its_words() -> None:
    tier = _tier(1000, "lru", 0.1, 0)
    keys = np.arange(1000, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, 4), np.ones(1000, np.int64))
    arrays = tier.table_arrays(TABLE)
    assert tier.table_bytes(TABLE) == 1000 * (24 + 16) + arrays.index.nbytes
