"""The hash map's compiled pass (``HashMapTier.lane``) answers what its batch get answers, key for key: random batches
with duplicates, keys never written, tombstones and the int64 edges, over a table whose index grew and whose rows
moved; it stamps the rows it read as the get does, and refuses an answer it would write out of bounds."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.engine.levels import VOLATILE
from hps_service.errors import InvalidArgumentError
from hps_service.tiers.hashmap.lane import SOURCE_VOLATILE, STAMP_EVERY, check_answer
from hps_service.tiers.hashmap.tier import HashMapTier

DIM = 6
I64 = np.iinfo(np.int64)
EDGES = np.array([I64.min, I64.min + 1, -1, 0, 1, I64.max - 1, I64.max], dtype=np.int64)


def _rows(keys: np.ndarray, version: int) -> np.ndarray:
    base = (keys % 100_003).astype(np.float32) * 8 + version
    return np.repeat(base[:, None], DIM, axis=1) + np.arange(DIM, dtype=np.float32)


def _read_only(keys: np.ndarray) -> np.ndarray:
    out = np.array(keys, dtype=np.int64, copy=True)
    out.flags.writeable = False
    return out


def test_its_source_code_is_the_engines() -> None:
    assert SOURCE_VOLATILE == VOLATILE


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_random_batches_answer_what_the_batch_get_answers(policy: str) -> None:
    tier = HashMapTier(capacity_rows=3000, overflow_policy=policy)
    tier.create_table("m.t", DIM)
    rng = np.random.default_rng(52)
    written = np.unique(np.concatenate([EDGES[::2], rng.integers(I64.min, I64.max, 2500, dtype=np.int64)]))
    for lo in range(0, written.shape[0], 300):  # the index doubles several times
        part = written[lo : lo + 300]
        tier.put("m.t", part, _rows(part, 1), np.ones(part.shape[0], np.int64))
    tier.put("m.t", written[::5], _rows(written[::5], 2), np.full(written[::5].shape[0], 2, np.int64))
    tier.delete("m.t", written[1::9], np.full(written[1::9].shape[0], 3, np.int64))  # tombstones
    tier.delete("m.t", written[2::11])  # forgotten: the last rows move into their places
    never = rng.integers(I64.min, I64.max, 300, dtype=np.int64)
    pool = np.concatenate([written, never, EDGES])
    lane = tier.lane("m.t")
    for _ in range(60):
        keys = rng.choice(pool, int(rng.integers(1, 700)))
        keys = np.concatenate([keys, keys[: int(rng.integers(0, 60))]])  # duplicates
        n = keys.shape[0]
        want = tier.get("m.t", keys)
        out = np.full((n, DIM), np.nan, np.float32)
        sources = np.zeros(n, np.uint8)
        miss = np.full(n, -7, np.int64)
        hits, complete = lane(_read_only(keys), out, sources, miss)
        assert not complete
        assert hits == int(want.found.sum())
        np.testing.assert_array_equal(miss[: n - hits], np.flatnonzero(~want.found))
        np.testing.assert_array_equal(out[want.found], want.vectors[want.found])
        assert (sources[want.found] == VOLATILE).all() and (sources[~want.found] == 0).all()
        assert np.isnan(out[~want.found]).all()  # the misses' rows are left to the caller


def test_it_stamps_the_rows_it_read_for_eviction_to_its_resolution() -> None:
    tier = HashMapTier(capacity_rows=100, evict_fraction=0.4)
    tier.create_table("m.t", DIM)
    keys = np.arange(100, dtype=np.int64)
    tier.put("m.t", keys, _rows(keys, 1), np.ones(100, np.int64))
    read = keys[:50]  # the rows stored first: without the reads' stamps, the eviction's ties would take them
    lane = tier.lane("m.t")

    def pass_over(asked: np.ndarray) -> None:
        lane(_read_only(asked), np.empty((asked.size, DIM), np.float32), np.empty(asked.size, np.uint8),
             np.empty(asked.size, np.int64))

    for _ in range(STAMP_EVERY + 1):  # a pass with a hit ticks: the put's stamps get old enough to be renewed
        pass_over(keys[99:])
    pass_over(read)
    tier.put("m.t", np.arange(1000, 1010, dtype=np.int64), _rows(np.arange(10), 1), np.ones(10, np.int64))
    assert tier.get("m.t", read).found.all()  # the eviction took the half not read
    assert not tier.get("m.t", keys[50:]).found.all()


def test_an_answer_it_cannot_write_into_is_refused() -> None:
    for out, sources in ((np.empty((4, DIM + 1), np.float32), np.empty(4, np.uint8)),
                         (np.empty((4, DIM), np.float64), np.empty(4, np.uint8)),
                         (np.empty((DIM, 4), np.float32).T, np.empty(4, np.uint8)),
                         (np.empty((4, DIM), np.float32), np.empty(3, np.uint8)),
                         (np.empty((4, DIM), np.float32), np.empty(4, np.int8))):
        with pytest.raises(InvalidArgumentError, match="the answer of 4 keys"):
            check_answer(out, sources, 4, DIM)
    frozen = np.empty((4, DIM), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgumentError):
        check_answer(frozen, np.empty(4, np.uint8), 4, DIM)
    check_answer(np.empty((4, DIM), np.float32), np.empty(4, np.uint8), 4, DIM)
