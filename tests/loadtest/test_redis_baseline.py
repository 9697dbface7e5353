"""The Redis Cluster baseline of the benchmarks answers the right rows, in the order asked, from a real cluster."""

from __future__ import annotations

import asyncio

import numpy as np

from loadtest.harness.drivers import BAD_RESPONSE
from loadtest.harness.redis_baseline import RedisMgetDriver, cluster_layout, load_rows
from tests.fixtures.redis_cluster import RedisClusterProcess

DIM = 16


def test_mget_per_master_returns_rows_in_request_order(redis_cluster_clean: RedisClusterProcess) -> None:
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(3000, dtype=np.int64) * 1_000_003 - 5000)  # negative keys too
    vectors = rng.standard_normal((keys.shape[0], DIM), dtype=np.float32)
    layout = cluster_layout(redis_cluster_clean.nodes[0])
    assert len(layout.nodes) == 3 and len(set(layout.tags)) == 3
    load_rows(layout, keys, vectors)
    pool = keys[rng.integers(0, keys.shape[0], size=(4, 200))]
    pool[0, :2] = pool[0, 0]  # a duplicate key within a batch
    driver = RedisMgetDriver(layout, pool, DIM)
    row_of = {int(k): i for i, k in enumerate(keys)}

    async def fetch_all() -> list[np.ndarray]:
        await driver.open()
        try:
            return [await driver.rows(i) for i in range(pool.shape[0])]
        finally:
            await driver.close()

    for batch, got in zip(pool, asyncio.run(fetch_all())):
        np.testing.assert_array_equal(got, vectors[[row_of[int(k)] for k in batch]])


def test_missing_key_is_a_bad_response(redis_cluster_clean: RedisClusterProcess) -> None:
    layout = cluster_layout(redis_cluster_clean.nodes[0])
    keys = np.arange(10, dtype=np.int64)
    load_rows(layout, keys, np.ones((10, DIM), np.float32))
    driver = RedisMgetDriver(layout, np.array([[1, 2, 99]], dtype=np.int64), DIM)

    async def one_call():
        await driver.open()
        try:
            return await driver.call(0)
        finally:
            await driver.close()

    result = asyncio.run(one_call())
    assert result.status == BAD_RESPONSE and result.keys == 0
