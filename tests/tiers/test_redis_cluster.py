"""RedisClusterTier against a real 3-master Redis Cluster: round trips, versions, deletes, and a killed master."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from redis.crc import key_slot

from hps_service.errors import InvalidArgumentError, NotFoundError
from hps_service.tiers.redis import RedisClusterTier
from tests.fixtures.redis_cluster import RedisClusterProcess

PARTITIONS = 64
RETRY_AFTER_S = 0.3


@pytest.fixture
def tier(redis_cluster_clean: RedisClusterProcess) -> Iterator[RedisClusterTier]:
    t = RedisClusterTier(
        redis_cluster_clean.nodes,
        partitions=PARTITIONS,
        socket_timeout_s=0.5,
        node_retry_after_s=RETRY_AFTER_S,
    )
    yield t
    t.close()


def _rows(n: int, dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def _owner_ports(cluster: RedisClusterProcess, table: str, keys: np.ndarray) -> np.ndarray:
    """The port of the master that holds each key, from CLUSTER SLOTS and the documented hash layout."""
    with cluster.client(0) as c:
        ranges = c.execute_command("CLUSTER", "SLOTS")
    slot_port = np.zeros(16384, dtype=np.int64)
    for start, end, primary, *_ in ranges:
        slot_port[start : end + 1] = primary[1]
    part_port = np.array([slot_port[key_slot(f"hps:{{{table}:{p}}}".encode())] for p in range(PARTITIONS)])
    return part_port[keys % PARTITIONS]


def test_round_trip_spans_all_nodes(tier: RedisClusterTier, redis_cluster_clean: RedisClusterProcess) -> None:
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.unique(rng.integers(-(10**12), 10**12, 3100)))[:3000]
    vectors = _rows(keys.size, 16, 1)
    tier.create_table("m.t", 16)
    written = tier.put("m.t", keys, vectors, np.arange(keys.size))
    assert written.all()
    assert set(_owner_ports(redis_cluster_clean, "m.t", keys)) == set(redis_cluster_clean.ports)
    for i in range(3):
        with redis_cluster_clean.client(i) as c:
            assert c.dbsize() > 0
    rows = tier.get("m.t", keys[::-1])
    assert rows.found.all()
    np.testing.assert_array_equal(rows.vectors, vectors[::-1])
    np.testing.assert_array_equal(rows.versions, np.arange(keys.size)[::-1])
    assert tier.count("m.t") == keys.size


def test_missing_keys_are_not_found_in_order(tier: RedisClusterTier) -> None:
    tier.create_table("m.t", 4)
    keys = np.arange(0, 200, 2, dtype=np.int64)
    vectors = _rows(keys.size, 4, 2)
    tier.put("m.t", keys, vectors, np.ones(keys.size, dtype=np.int64))
    asked = np.array([1, 0, 3, 198, 199, -2, 50], dtype=np.int64)
    rows = tier.get("m.t", asked)
    np.testing.assert_array_equal(rows.found, [False, True, False, True, False, False, True])
    np.testing.assert_array_equal(rows.vectors[[1, 3, 6]], vectors[[0, 99, 25]])
    assert tier.get("m.t", np.array([], dtype=np.int64)).found.shape == (0,)


def test_extreme_and_negative_keys(tier: RedisClusterTier) -> None:
    tier.create_table("m.t", 3)
    keys = np.array([-1, -(2**63), 2**63 - 1, 0, -64, -65], dtype=np.int64)
    vectors = _rows(keys.size, 3, 3)
    assert tier.put("m.t", keys, vectors, np.zeros(keys.size, dtype=np.int64)).all()
    rows = tier.get("m.t", keys)
    assert rows.found.all()
    np.testing.assert_array_equal(rows.vectors, vectors)


@pytest.mark.parametrize(
    ("stored", "offered", "expect_written"),
    [
        (10, 9, False),
        (10, 10, True),
        (10, 11, True),
        (-3, -5, False),
        (-5, -3, True),
        (-1, 0, True),
        (0, -1, False),
        (2**62 + 1, 2**62, False),  # differ below double precision: exact int64 compare needed
        (2**62, 2**62 + 1, True),
        (2**63 - 1, -(2**63), False),
        (255, 256, True),
        (256, 255, False),
    ],
)
def test_versions_never_go_backwards(
    tier: RedisClusterTier, stored: int, offered: int, expect_written: bool
) -> None:
    tier.create_table("m.t", 2)
    key = np.array([42], dtype=np.int64)
    old = np.array([[1.0, 1.0]], dtype=np.float32)
    new = np.array([[2.0, 2.0]], dtype=np.float32)
    assert tier.put("m.t", key, old, np.array([stored])).all()
    written = tier.put("m.t", key, new, np.array([offered]))
    assert bool(written[0]) is expect_written
    rows = tier.get("m.t", key)
    np.testing.assert_array_equal(rows.vectors, new if expect_written else old)
    assert rows.versions[0] == (offered if expect_written else stored)


def test_put_mask_mixes_older_and_newer_in_one_batch(tier: RedisClusterTier) -> None:
    tier.create_table("m.t", 4)
    keys = np.arange(500, dtype=np.int64)
    tier.put("m.t", keys, _rows(500, 4, 4), np.full(500, 100))
    offered = np.where(keys % 3 == 0, 99, 101)
    written = tier.put("m.t", keys, _rows(500, 4, 5), offered)
    np.testing.assert_array_equal(written, keys % 3 != 0)
    np.testing.assert_array_equal(tier.get("m.t", keys).versions, np.where(keys % 3 == 0, 100, 101))


def test_delete_and_count(tier: RedisClusterTier) -> None:
    tier.create_table("m.t", 4)
    keys = np.arange(-300, 300, dtype=np.int64)
    tier.put("m.t", keys, _rows(keys.size, 4, 6), np.zeros(keys.size, dtype=np.int64))
    assert tier.count("m.t") == 600
    assert tier.delete("m.t", np.r_[keys[:100], np.array([10**9])]) == 100
    assert tier.count("m.t") == 500
    assert tier.stats("m.t").rows == 500
    found = tier.get("m.t", keys).found
    np.testing.assert_array_equal(found, np.arange(600) >= 100)
    tier.drop_table("m.t")
    with pytest.raises(NotFoundError):
        tier.get("m.t", keys)


def test_versioned_delete_leaves_tombstones_that_refuse_older_puts(tier: RedisClusterTier) -> None:
    tier.create_table("m.t", 2)  # dim 2: a row is 16 bytes, a tombstone 8
    keys = np.arange(-100, 100, dtype=np.int64)
    tier.put("m.t", keys, _rows(200, 2, 7), np.full(200, 5))
    assert tier.delete("m.t", keys[:100], np.full(100, 4)) == 0  # a lagging delete keeps the newer rows
    assert tier.get("m.t", keys).found.all()
    assert tier.delete("m.t", keys[:100], np.full(100, 5)) == 100
    absent = np.arange(10**6, 10**6 + 20, dtype=np.int64)
    assert tier.delete("m.t", absent, 9) == 0
    assert tier.count("m.t") == 100 and tier.tombstones("m.t") == 120 and tier.stats("m.t").rows == 100
    assert not tier.get("m.t", np.r_[keys[:100], absent]).found.any()
    old = _rows(100, 2, 8)
    assert not tier.put("m.t", keys[:100], old, np.full(100, 5)).any()  # at the tombstone's version
    assert not tier.put("m.t", keys[:100], old, np.full(100, 3)).any()  # a replay or a late promotion
    assert tier.delete("m.t", keys[:10], np.full(10, 1)) == 0  # never lowers a tombstone
    assert not tier.put("m.t", keys[:10], old[:10], np.full(10, 4)).any()
    newer = tier.put("m.t", keys[:100], old, np.full(100, 6))
    assert newer.all()
    np.testing.assert_array_equal(tier.get("m.t", keys[:100]).vectors, old)
    assert tier.count("m.t") == 200 and tier.tombstones("m.t") == 20
    assert tier.delete("m.t", np.r_[absent, keys[:5]]) == 5  # unversioned: rows and tombstones go
    assert tier.tombstones("m.t") == 0 and tier.count("m.t") == 195
    assert tier.put("m.t", absent, _rows(20, 2, 9), np.zeros(20, np.int64)).all()


@pytest.mark.parametrize(
    ("stored", "deleted", "removed"),
    [
        (-1, 0, True),
        (0, -1, False),
        (2**53 + 1, 2**53, False),
        (2**53, 2**53 + 1, True),
        (-(2**63), -(2**63), True),
    ],
)
def test_versioned_delete_compares_extreme_versions(
    tier: RedisClusterTier, stored: int, deleted: int, removed: bool
) -> None:
    tier.create_table("m.t", 2)
    key = np.array([7], dtype=np.int64)
    tier.put("m.t", key, np.ones((1, 2), np.float32), np.array([stored]))
    assert tier.delete("m.t", key, np.array([deleted])) == int(removed)
    assert bool(tier.get("m.t", key).found[0]) is not removed
    if removed:  # the tombstone holds exactly the delete's version
        assert not tier.put("m.t", key, np.ones((1, 2), np.float32), np.array([deleted])).any()
        if deleted < 2**63 - 1:
            assert tier.put("m.t", key, np.ones((1, 2), np.float32), np.array([deleted + 1])).all()


def test_purge_tombstones_and_scripts_reload_after_flush(
    tier: RedisClusterTier, redis_cluster_clean: RedisClusterProcess
) -> None:
    tier.create_table("m.t", 4)
    keys = np.arange(3000, dtype=np.int64)
    tier.put("m.t", keys, _rows(3000, 4, 10), np.zeros(3000, np.int64))
    for i in range(3):  # a restarted node has an empty script cache: the tier must EVAL the scripts again
        with redis_cluster_clean.client(i) as c:
            c.script_flush()
    assert tier.delete("m.t", keys[:2000], np.repeat([10, 20], 1000)) == 2000
    assert tier.purge_tombstones("m.t", 20, page=100) == 1000
    assert tier.tombstones("m.t") == 1000 and tier.count("m.t") == 1000
    written = tier.put("m.t", keys[:2000], _rows(2000, 4, 11), np.full(2000, 15))
    np.testing.assert_array_equal(written, np.arange(2000) < 1000)
    assert tier.purge_tombstones("m.t", 21) == 1000 and tier.tombstones("m.t") == 0
    assert tier.count("m.t") == 2000


def test_tables_with_different_dims_are_independent(
    tier: RedisClusterTier, redis_cluster_clean: RedisClusterProcess
) -> None:
    tier.create_table("m.small", 2)
    tier.create_table("m.big", 64)
    keys = np.arange(100, dtype=np.int64)
    small, big = _rows(100, 2, 7), _rows(100, 64, 8)
    tier.put("m.small", keys, small, np.zeros(100, dtype=np.int64))
    tier.put("m.big", keys[:50], big[:50], np.zeros(50, dtype=np.int64))
    np.testing.assert_array_equal(tier.get("m.small", keys).vectors, small)
    rows = tier.get("m.big", keys)
    np.testing.assert_array_equal(rows.found, np.arange(100) < 50)
    np.testing.assert_array_equal(rows.vectors[:50], big[:50])
    assert tier.count("m.small") == 100 and tier.count("m.big") == 50
    other = RedisClusterTier(redis_cluster_clean.nodes)
    try:
        assert other.get("m.big", keys[:1]).vectors.shape == (1, 64)  # dim read back from the meta key
        with pytest.raises(InvalidArgumentError):
            other.create_table("m.big", 32)
    finally:
        other.close()


def test_invalid_arguments(tier: RedisClusterTier) -> None:
    tier.create_table("m.t", 4)
    with pytest.raises(NotFoundError):
        tier.get("m.unknown", np.arange(3))
    with pytest.raises(InvalidArgumentError):
        tier.put("m.t", np.arange(3), np.zeros((3, 5), dtype=np.float32), np.zeros(3, dtype=np.int64))
    with pytest.raises(InvalidArgumentError):
        tier.get("m.t", np.array([1.5, 2.0]))
    with pytest.raises(InvalidArgumentError):
        tier.create_table("m.{bad}", 4)
    with pytest.raises(InvalidArgumentError):
        RedisClusterTier(["no-port"])


def test_concurrent_gets(tier: RedisClusterTier) -> None:
    tier.create_table("m.t", 8)
    keys = np.arange(2000, dtype=np.int64)
    vectors = _rows(2000, 8, 9)
    tier.put("m.t", keys, vectors, np.zeros(2000, dtype=np.int64))

    def reader(seed: int) -> int:
        rng = np.random.default_rng(seed)
        for _ in range(30):
            ask = rng.choice(keys, 256, replace=False)
            rows = tier.get("m.t", ask)
            assert rows.found.all()
            np.testing.assert_array_equal(rows.vectors, vectors[ask])
        return 30

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert sum(f.result() for f in [pool.submit(reader, s) for s in range(6)]) == 180


def test_killed_master_falls_through_then_recovers(
    tier: RedisClusterTier, redis_cluster_clean: RedisClusterProcess
) -> None:
    cluster = redis_cluster_clean
    tier.create_table("m.t", 8)
    keys = np.arange(-1500, 1500, dtype=np.int64)
    vectors = _rows(keys.size, 8, 10)
    tier.put("m.t", keys, vectors, np.ones(keys.size, dtype=np.int64))
    on_victim = _owner_ports(cluster, "m.t", keys) == cluster.ports[1]
    assert on_victim.any() and not on_victim.all()

    cluster.kill(1)
    try:
        rows = tier.get("m.t", keys)
        np.testing.assert_array_equal(rows.found, ~on_victim)
        np.testing.assert_array_equal(rows.vectors[~on_victim], vectors[~on_victim])
        after_failure = tier.stats("m.t")
        assert after_failure.errors >= 1
        assert after_failure.extra["node_failures"] == 1
        assert after_failure.extra["failed_keys"] >= on_victim.sum()

        rows = tier.get("m.t", keys)  # the dead node is in back-off: skipped, not tried
        np.testing.assert_array_equal(rows.found, ~on_victim)
        after_skip = tier.stats("m.t")
        assert after_skip.extra["node_failures"] == 1
        assert after_skip.extra["node_skips"] > after_failure.extra["node_skips"]

        newer = vectors + 1
        written = tier.put("m.t", keys, newer, np.full(keys.size, 2))
        np.testing.assert_array_equal(written, ~on_victim)
        assert tier.healthy()
    finally:
        cluster.restart(1)

    time.sleep(RETRY_AFTER_S * 1.5)
    written = tier.put("m.t", keys, vectors + 2, np.full(keys.size, 3))  # the restarted node came back empty
    assert written.all()
    rows = tier.get("m.t", keys)
    assert rows.found.all()
    np.testing.assert_array_equal(rows.vectors, vectors + 2)
    assert tier.stats("m.t").extra["nodes_down"] == 0


def test_hung_master_times_out_and_is_skipped(
    tier: RedisClusterTier, redis_cluster_clean: RedisClusterProcess
) -> None:
    cluster = redis_cluster_clean
    tier.create_table("m.t", 4)
    keys = np.arange(600, dtype=np.int64)
    vectors = _rows(keys.size, 4, 11)
    tier.put("m.t", keys, vectors, np.zeros(keys.size, dtype=np.int64))
    on_victim = _owner_ports(cluster, "m.t", keys) == cluster.ports[2]
    cluster.pause(2)
    try:
        rows = tier.get("m.t", keys)  # the hung node's reply times out after socket_timeout_s
        np.testing.assert_array_equal(rows.found, ~on_victim)
        np.testing.assert_array_equal(rows.vectors[~on_victim], vectors[~on_victim])
        rows = tier.get("m.t", keys)
        np.testing.assert_array_equal(rows.found, ~on_victim)
        stats = tier.stats("m.t")
        assert stats.extra["node_failures"] == 1 and stats.extra["node_skips"] >= 1
    finally:
        cluster.resume(2)
    time.sleep(RETRY_AFTER_S * 1.5)
    rows = tier.get("m.t", keys)
    assert rows.found.all()
    np.testing.assert_array_equal(rows.vectors, vectors)
