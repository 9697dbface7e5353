"""``Tier.fill``: a tier fills only the holes a level above left, exactly as ``get`` answers the same keys.

The hash map's compiled fill and the default (``get`` once per distinct key, as RocksDB and Redis use it) are
compared with ``get`` on random batches with duplicates, absent and deleted keys and the int64 edges; rows outside
the holes are never written.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hps_service.errors import InvalidArgumentError
from hps_service.tiers.base import Tier
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

TABLE, DIM = "demo.item", 4
I64 = np.iinfo(np.int64)
EDGES = np.array([I64.min, I64.min + 1, -1, 0, 1, I64.max - 1, I64.max], dtype=np.int64)
#: Stored keys: the edges and a few hundred others; deleted ones with a tombstone (a versioned delete).
STORED = np.concatenate([EDGES, np.arange(-300, 300, 3, dtype=np.int64) * 7_919])
DELETED = STORED[::11]


def _rows(keys: np.ndarray) -> np.ndarray:
    """A row that encodes its key, so another key's row is caught."""
    return np.repeat((keys % 100_003).astype(np.float32)[:, None], DIM, axis=1) + np.arange(DIM, dtype=np.float32)


@pytest.fixture(params=["hashmap", "rocksdb"], scope="module")
def tier(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    store: Tier = (HashMapTier(10_000) if request.param == "hashmap"
                   else RocksDBTier(Path(tmp_path_factory.mktemp("rocksdb"))))
    store.create_table(TABLE, DIM)
    store.put(TABLE, STORED, _rows(STORED), np.arange(STORED.shape[0], dtype=np.int64) + 5)
    store.delete(TABLE, DELETED, np.full(DELETED.shape[0], 10_000, dtype=np.int64))
    yield store
    store.close()


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.integers(0, 2 * STORED.shape[0]), min_size=0, max_size=120),
       hole_bits=st.lists(st.booleans(), min_size=120, max_size=120))
def test_fill_answers_the_holes_as_get_answers_their_keys(tier: Tier, picks: list[int], hole_bits: list[bool]) -> None:
    # picks past the stored keys name keys never stored (odd multiples of a large prime)
    keys = np.array([STORED[p] if p < STORED.shape[0] else (2 * p + 1) * 1_000_003 for p in picks], dtype=np.int64)
    holes = np.flatnonzero(np.array(hole_bits[: keys.shape[0]], dtype=bool))
    out = np.full((keys.shape[0], DIM), -7.0, dtype=np.float32)
    versions = np.empty(holes.shape[0], dtype=np.int64)
    found = np.empty(holes.shape[0], dtype=bool)

    n = tier.fill(TABLE, keys, holes, out, versions, found)

    want = tier.get(TABLE, keys[holes])
    assert n == int(want.found.sum())
    np.testing.assert_array_equal(found, want.found)
    np.testing.assert_array_equal(versions[found], want.versions[want.found])
    np.testing.assert_array_equal(out[holes[found]], want.vectors[want.found])
    np.testing.assert_array_equal(out[holes[found]], _rows(keys[holes[found]]))
    assert not np.isin(keys[holes[found]], DELETED).any()
    untouched = np.ones(keys.shape[0], dtype=bool)
    untouched[holes[found]] = False
    assert (out[untouched] == -7.0).all()


def test_fill_refuses_positions_outside_the_keys_and_a_wrong_answer_shape() -> None:
    store = HashMapTier(100)
    store.create_table(TABLE, DIM)
    keys = EDGES.copy()
    versions, found = np.empty(2, np.int64), np.empty(2, bool)
    with pytest.raises(InvalidArgumentError, match="positions"):
        store.fill(TABLE, keys, np.array([0, keys.shape[0]]), np.empty((keys.shape[0], DIM), np.float32), versions,
                   found)
    with pytest.raises(InvalidArgumentError, match="positions"):
        store.fill(TABLE, keys, np.array([-1, 2]), np.empty((keys.shape[0], DIM), np.float32), versions, found)
    with pytest.raises(InvalidArgumentError, match="shape"):
        store.fill(TABLE, keys, np.array([0, 1]), np.empty((keys.shape[0], DIM + 1), np.float32), versions, found)
