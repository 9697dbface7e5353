"""HPSClient and AsyncHPSClient over in-process shards: the shard map learned from GetClusterInfo, batches split by
shard and answered in the order asked (several tables, duplicates, absent keys, empty tables), a shard without a
reachable target named in UnavailableError, a replica found once it comes up, the map learned again when a server
refuses a key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_client import StreamRequest
from hps_service.aio_client import AsyncHPSClient
from hps_service.client import HPSClient
from hps_service.config import HPSConfig
from hps_service.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from hps_service.serve.process import HPSServer
from hps_service.updates.partitioning import shard_of
from tests.helpers import free_port
from tests.server.conftest import AUTH, ITEM_DIM, USER_DIM, base_url, running, server_config, target

P = 8
KEYS = np.arange(1, 3001, dtype=np.int64) * 104729
ITEM = np.random.default_rng(1).standard_normal((KEYS.size, ITEM_DIM)).astype(np.float32)
USER = np.random.default_rng(2).standard_normal((KEYS.size, USER_DIM)).astype(np.float32)


def shard_config(tmp: Path, shard: int, shards: int = 2, partitions: int = P, grpc_port: int | None = None) -> HPSConfig:
    cfg = server_config(tmp)
    server = cfg.server.model_copy(update={"grpc_port": grpc_port}) if grpc_port else cfg.server
    cluster = cfg.cluster.model_copy(update={"shards": shards, "shard": shard, "partitions": partitions})
    return cfg.model_copy(update={"cluster": cluster, "server": server})


def fill(srv: HPSServer, shards: int = 2) -> None:
    """Put the shard's rows of both tables on ``srv`` (REST, so each replica holds its own copy)."""
    own = shard_of(KEYS, P, shards) == srv.shard_map.shard
    for table, rows in (("item", ITEM), ("user", USER)):
        r = httpx.put(f"{base_url(srv)}/v1/models/demo/tables/{table}/embeddings", headers=AUTH, timeout=30,
                      json={"keys": KEYS[own].tolist(), "vectors": rows[own].tolist(), "version": 1})
        assert r.status_code == 200, r.text


@contextmanager
def fleet(tmp: Path, layout: list[int]) -> Iterator[list[HPSServer]]:
    """One in-process server per entry of ``layout`` (its shard), filled with that shard's rows."""
    with ExitStack() as stack:
        servers = [stack.enter_context(running(shard_config(tmp / f"r{i}", s))) for i, s in enumerate(layout)]
        for srv in servers:
            fill(srv)
        yield servers


def expected(ask: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pos = np.searchsorted(KEYS, ask)
    stored = (pos < KEYS.size) & (KEYS[np.minimum(pos, KEYS.size - 1)] == ask)
    out = np.zeros((ask.size, rows.shape[1]), dtype=np.float32)
    out[stored] = rows[pos[stored]]
    return out, stored


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[HPSServer]]:
    with fleet(tmp_path_factory.mktemp("shards"), [0, 1, 0]) as servers:  # shard 0 has two replicas
        yield servers


ASK = np.concatenate((KEYS[::-3], KEYS[:50], KEYS[:50], np.array([-1, 7, 2**62], dtype=np.int64)))


def check(answers: dict, user_keys: np.ndarray) -> None:
    rows, stored = expected(ASK, ITEM)
    np.testing.assert_array_equal(answers["item"].vectors, rows)
    assert (answers["item"].sources[stored] != 4).all() and (answers["item"].sources[~stored] == 4).all()
    np.testing.assert_array_equal(answers["user"].vectors, expected(user_keys, USER)[0])


def test_sync_client_splits_by_shard_and_answers_in_order(shards: list[HPSServer]) -> None:
    user_keys = KEYS[[5, 5, 17, 2999]]
    with HPSClient([target(s) for s in shards]) as client:
        check(client.lookup_many("demo", {"item": ASK, "user": user_keys}), user_keys)
        assert client.lookup("demo", "user", np.empty(0, dtype=np.int64)).shape == (0, USER_DIM)
        one_empty = client.lookup_many("demo", {"item": KEYS[:5], "user": np.empty(0, dtype=np.int64)})
        assert one_empty["user"].vectors.shape == (0, USER_DIM) and one_empty["item"].vectors.shape == (5, ITEM_DIM)
        only_one_shard = KEYS[shard_of(KEYS, P, 2) == 1][:10]
        np.testing.assert_array_equal(client.lookup("demo", "item", only_one_shard), expected(only_one_shard, ITEM)[0])
        assert client.list_models() == {"demo": {"item": ITEM_DIM, "user": USER_DIM}}
        assert client.cluster_info()["shards"] == 2


def test_async_client_splits_by_shard_and_answers_in_order(shards: list[HPSServer]) -> None:
    user_keys = KEYS[[3, 3000 - 1]]

    async def run() -> None:
        async with AsyncHPSClient([target(s) for s in shards]) as client:
            check(await client.lookup_many("demo", {"item": ASK, "user": user_keys}), user_keys)
            assert (await client.cluster_info())["partitions"] == P

    asyncio.run(run())


def _lookups(servers: list[HPSServer]) -> float:
    return sum(s.metrics.requests_served("Lookup") for s in servers if s.metrics is not None)


def test_concurrent_lookups_coalesce_before_the_shard_split(shards: list[HPSServer]) -> None:
    """200 concurrent 2-key lookups, their keys on both shards: one merged batch, split as any batch is (a call to
    each shard), each caller answered its own rows."""
    asks = [KEYS[[i, 2999 - i]] for i in range(200)]

    async def run() -> tuple[list[np.ndarray], float]:
        async with AsyncHPSClient([target(s) for s in shards], timeout=30) as client:
            await client.lookup("demo", "item", KEYS[:2])  # the shard map, learned
            before = _lookups(shards)
            got = await asyncio.gather(*(client.lookup("demo", "item", ask) for ask in asks))
            return got, _lookups(shards) - before

    got, calls = asyncio.run(run())
    assert calls == 2
    for ask, rows in zip(asks, got):
        np.testing.assert_array_equal(rows, expected(ask, ITEM)[0])


def test_a_stream_is_refused_on_a_sharded_fleet(shards: list[HPSServer]) -> None:
    with HPSClient([target(s) for s in shards]) as client, pytest.raises(
            FailedPreconditionError, match="sharded fleet of 2 shards: use lookup"):
        client.lookup_stream([StreamRequest("demo", {"item": KEYS[:3]})])

    async def run() -> None:
        async with AsyncHPSClient([target(s) for s in shards]) as client:
            with pytest.raises(FailedPreconditionError, match="sharded fleet of 2 shards"):
                async for _ in client.lookup_stream([StreamRequest("demo", {"item": KEYS[:3]})]):
                    pass

    asyncio.run(run())


def test_a_shard_no_target_serves_is_named(shards: list[HPSServer]) -> None:
    shard0_only = [target(shards[0]), target(shards[2])]
    owned = KEYS[shard_of(KEYS, P, 2) == 0][:20]
    with HPSClient(shard0_only) as client:
        np.testing.assert_array_equal(client.lookup("demo", "item", owned), expected(owned, ITEM)[0])
        with pytest.raises(UnavailableError) as err:
            client.lookup("demo", "item", KEYS[:100])
        n1 = int((shard_of(KEYS[:100], P, 2) == 1).sum())
        assert f"shard 1 of 2 is unavailable: no replica answered ({n1} of the 100 keys asked" in str(err.value)

    async def run() -> None:
        async with AsyncHPSClient(shard0_only) as client:
            with pytest.raises(UnavailableError, match="shard 1 of 2 is unavailable"):
                await client.lookup("demo", "item", KEYS[:100])

    asyncio.run(run())


def test_targets_of_different_fleets_are_refused(shards: list[HPSServer], tmp_path: Path) -> None:
    with running(shard_config(tmp_path, 0, shards=4)) as other, \
            HPSClient([target(shards[0]), target(other)]) as client, \
            pytest.raises(InvalidArgumentError, match="disagree on the shard map"):
        client.lookup("demo", "item", KEYS[:10])


def test_a_replica_down_at_first_use_is_used_once_it_comes_up(tmp_path: Path) -> None:
    late_port = free_port()
    with fleet(tmp_path, [0, 1]) as (first, shard1):
        client = HPSClient([target(first), target(shard1), f"127.0.0.1:{late_port}"], timeout=10)
        with client:
            np.testing.assert_array_equal(client.lookup("demo", "item", KEYS[:200]), ITEM[:200])
            with running(shard_config(tmp_path / "late", 0, grpc_port=late_port)) as late:
                fill(late)
                deadline = time.monotonic() + 30
                while 2 not in client.transport._routes.known and time.monotonic() < deadline:  # noqa: SLF001
                    client.lookup("demo", "item", KEYS[:8])
                    time.sleep(0.1)
                first.stop(grace=0)  # shard 0 now has only the replica that was down when the client started
                np.testing.assert_array_equal(client.lookup("demo", "item", KEYS[:200]), ITEM[:200])


def test_the_shard_map_is_learned_again_when_a_server_refuses_a_key(tmp_path: Path) -> None:
    cfg = server_config(tmp_path / "a")
    port = cfg.server.grpc_port
    with HPSClient(f"127.0.0.1:{port}") as client:
        with running(cfg) as whole:
            fill(whole, shards=1)
            np.testing.assert_array_equal(client.lookup("demo", "item", KEYS[:100]), ITEM[:100])  # unsharded
        with running(shard_config(tmp_path / "b", 0, grpc_port=port)) as shard0:  # resharded: now shard 0 of 2
            fill(shard0)
            client.wait_ready(10)  # reconnected (the channel backs off after losing the first server)
            with pytest.raises(UnavailableError, match="shard 1 of 2 is unavailable"):
                client.lookup("demo", "item", KEYS[:100])
            owned = KEYS[shard_of(KEYS, P, 2) == 0][:50]
            np.testing.assert_array_equal(client.lookup("demo", "item", owned), expected(owned, ITEM)[0])


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_bags_over_two_shards_equal_the_unsharded_answer(shards: list[HPSServer], combiner: str) -> None:
    """Each shard sums its share of every bag (with the weights); the client adds the shares and divides by the
    whole bag's length for a mean: what one server holding every row answers, within float32 rounding."""
    from hps_client import Bags
    from tests.engine.test_bags import reference

    rng = np.random.default_rng(9)
    lengths = rng.poisson(6, 40)
    lengths[::7] = 0  # empty bags, and bags whose keys are all on one shard
    keys = rng.choice(np.concatenate((KEYS, [-1, 7])), int(lengths.sum())).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    weights = rng.standard_normal(keys.size).astype(np.float32) if combiner == "sum" else None
    rows, stored = expected(keys, ITEM)
    rows[~stored] = 0.0  # the item table's default
    want, _ = reference(rows, np.where(stored, 1, 4).astype(np.uint8), offsets, 2 if combiner == "mean" else 1,
                        weights)
    with HPSClient([target(s) for s in shards]) as client:
        got = client.lookup_bags_many("demo", {"item": Bags(keys, offsets, combiner, weights)})["item"]
        np.testing.assert_allclose(got.vectors, want, rtol=1e-5, atol=1e-5)
        has_default = np.add.reduceat(~stored, offsets) * (lengths > 0) > 0
        assert ((got.sources == 4) == has_default).all() and (got.sources[lengths == 0] == 0).all()

    async def pooled() -> np.ndarray:
        async with AsyncHPSClient([target(s) for s in shards]) as aio:
            return await aio.lookup_bags("demo", "item", keys, offsets, combiner, weights)

    np.testing.assert_allclose(asyncio.run(pooled()), want, rtol=1e-5, atol=1e-5)
