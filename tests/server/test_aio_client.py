"""AsyncHPSClient against two real servers: round robin, retries past a stopped replica, errors, timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_client import DeadlineExceededError
from hps_service.aio_client import AsyncHPSClient
from hps_service.client import HPSClient, build_request
from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from tests.helpers import free_port
from tests.server.conftest import AUTH, ITEM_DIM, HeldLookups, base_url, running, server_config, target

KEYS = np.arange(1, 21, dtype=np.int64)
ROWS = np.arange(20 * ITEM_DIM, dtype=np.float32).reshape(20, ITEM_DIM)


def _lookups_served(srv: HPSServer) -> float:
    assert srv.metrics is not None
    return srv.metrics.requests_served("Lookup")


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[HPSServer]]:
    """Two servers holding the same rows (as two pods of one deployment would)."""
    with ExitStack() as stack:
        servers = [stack.enter_context(running(server_config(tmp_path / f"r{i}"))) for i in range(2)]
        for srv in servers:
            with httpx.Client(base_url=base_url(srv)) as http:
                body = {"keys": KEYS.tolist(), "vectors": ROWS.tolist()}
                assert http.put("/v1/models/demo/tables/item/embeddings", json=body, headers=AUTH).status_code == 200
        yield servers


def test_round_robin_over_replicas(replicas: list[HPSServer]) -> None:
    """One channel over both replicas (gRPC's round_robin): once both are connected, calls alternate (coalescing
    off, so that ten concurrent lookups are ten calls)."""

    async def main() -> list[float]:
        async with AsyncHPSClient([target(s) for s in replicas], timeout=30, coalesce_window_s=0) as client:
            for _ in range(200):  # until the channel has connected to both (the first calls go to the first one up)
                await client.lookup("demo", "item", KEYS[:1])
                if all(_lookups_served(s) for s in replicas):
                    break
            before = [_lookups_served(s) for s in replicas]
            results = await asyncio.gather(*(client.lookup("demo", "item", KEYS) for _ in range(10)))
            for got in results:
                np.testing.assert_array_equal(got, ROWS)
            assert await client.list_models() == {"demo": {"item": ITEM_DIM, "user": 4}}
            many = await client.lookup_many("demo", {"item": KEYS[:3], "user": [1]})
            np.testing.assert_array_equal(many["item"].vectors, ROWS[:3])
            answer = await client.lookup_with_sources("demo", "item", [999_999])
            assert answer.sources.tolist() == [4]
            return [_lookups_served(s) - b for s, b in zip(replicas, before)]

    assert asyncio.run(main()) == [6, 6]  # 10 + 1 + 1 lookups, alternating


def test_retries_past_a_stopped_replica(replicas: list[HPSServer]) -> None:
    live, stopped = replicas
    stopped.stop(grace=0)
    before = _lookups_served(live)

    async def main() -> None:
        async with AsyncHPSClient([target(stopped), target(live)], retries=2, backoff_s=0.01, timeout=30) as client:
            for _ in range(6):
                np.testing.assert_array_equal(await client.lookup("demo", "item", KEYS), ROWS)

    asyncio.run(main())
    assert _lookups_served(live) - before == 6
    with HPSClient([target(stopped), target(live)], retries=2, backoff_s=0.01) as sync_client:
        for _ in range(4):
            np.testing.assert_array_equal(sync_client.lookup("demo", "item", KEYS), ROWS)
    assert _lookups_served(live) - before == 10


def test_errors_timeouts_and_no_live_target(replicas: list[HPSServer]) -> None:
    dead = f"127.0.0.1:{free_port()}"

    async def main() -> None:
        async with AsyncHPSClient(target(replicas[0]), timeout=10) as client:
            with pytest.raises(NotFoundError, match="no table 'nope'"):
                await client.lookup("demo", "nope", [1])
            with pytest.raises(InvalidArgumentError):
                await client.lookup("demo", "item", [1.5])
        async with AsyncHPSClient([dead], retries=2, backoff_s=0.01, timeout=2) as client:
            with pytest.raises(UnavailableError):
                await client.lookup("demo", "item", KEYS)

    asyncio.run(main())
    with pytest.raises(InvalidArgumentError):
        AsyncHPSClient([])


def test_per_call_timeout(tmp_path: Path) -> None:
    """The only handler thread (gRPC served by the owner, on one thread) is held by a lookup: a lookup with a short
    per-call timeout fails with DEADLINE_EXCEEDED (not retried), and the next one, with the default timeout, is
    answered."""
    with running(server_config(tmp_path, grpc_workers=1, workers=0)) as srv, HeldLookups(srv, "user") as held, \
            grpc.insecure_channel(target(srv)) as channel:
        holder = pb_grpc.EmbeddingServiceStub(channel).Lookup.future(build_request("demo", {"user": [1]}), timeout=30)
        held.wait_entered()

        async def main() -> None:
            async with AsyncHPSClient(target(srv), timeout=30) as client:
                with pytest.raises(DeadlineExceededError, match="DEADLINE_EXCEEDED") as raised:
                    await client.lookup("demo", "item", KEYS, timeout=0.3)
                assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and isinstance(raised.value, TimeoutError)
                held.release()
                assert (await client.lookup("demo", "item", KEYS)).shape == (KEYS.shape[0], ITEM_DIM)

        asyncio.run(main())
        assert holder.result().tables[0].count == 1


def test_a_draining_replica_answers_unavailable_and_calls_go_to_the_other(replicas: list[HPSServer]) -> None:
    """A draining server refuses with UNAVAILABLE (never CANCELLED); the channel's retry policy sends the call to
    the other replica, so both clients get every answer. Alone, the draining one is left by the client's health
    check (its accepting service says NOT_SERVING) and the caller is told no replica accepts calls."""
    live, draining = replicas
    draining.gate.close("the server is draining")
    draining.update_health()  # what its health loop does within 0.2 s
    with grpc.insecure_channel(target(draining)) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.EmbeddingServiceStub(channel).Lookup(build_request("demo", {"item": KEYS}), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
    before = _lookups_served(live)
    with HPSClient([target(draining), target(live)], retries=2, backoff_s=0.01) as client:
        for _ in range(8):
            np.testing.assert_array_equal(client.lookup("demo", "item", KEYS), ROWS)

    async def main() -> None:
        async with AsyncHPSClient([target(draining), target(live)], retries=2, backoff_s=0.01, timeout=30) as client:
            for _ in range(8):
                np.testing.assert_array_equal(await client.lookup("demo", "item", KEYS), ROWS)

    asyncio.run(main())
    assert _lookups_served(live) - before == 16
    with HPSClient(target(draining), retries=1, backoff_s=0.01) as client, pytest.raises(
            UnavailableError, match="no replica is accepting calls"):
        client.lookup("demo", "item", KEYS)
