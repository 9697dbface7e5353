"""AsyncHPSClient against two real servers: round robin, retries past a stopped replica, errors, timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_service.aio_client import AsyncHPSClient
from hps_service.client import HPSClient, LookupError_, build_request
from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.server.app import HPSServer
from tests.helpers import free_port
from tests.server.conftest import AUTH, ITEM_DIM, OpenStream, base_url, running, server_config, target

KEYS = np.arange(1, 21, dtype=np.int64)
ROWS = np.arange(20 * ITEM_DIM, dtype=np.float32).reshape(20, ITEM_DIM)


def _lookups_served(srv: HPSServer) -> float:
    assert srv.metrics is not None
    return srv.metrics.requests.labels("Lookup", "OK")._value.get()


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
    async def main() -> None:
        async with AsyncHPSClient([target(s) for s in replicas], timeout=30) as client:
            results = await asyncio.gather(*(client.lookup("demo", "item", KEYS) for _ in range(10)))
            for got in results:
                np.testing.assert_array_equal(got, ROWS)
            assert await client.list_models() == {"demo": {"item": ITEM_DIM, "user": 4}}
            many = await client.lookup_many("demo", {"item": KEYS[:3], "user": [1]})
            np.testing.assert_array_equal(many["item"].vectors, ROWS[:3])
            answer = await client.lookup_with_sources("demo", "item", [999_999])
            assert answer.sources.tolist() == [4]

    asyncio.run(main())
    assert [_lookups_served(s) for s in replicas] == [6, 6]  # 10 + 1 + 1 lookups, alternating


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
    """The only worker is held by an open stream: a lookup with a short per-call timeout fails with
    DEADLINE_EXCEEDED (not retried), and the next one, with the default timeout, is answered."""
    with running(server_config(tmp_path, grpc_workers=1)) as srv, grpc.insecure_channel(target(srv)) as channel:
        stream = OpenStream(pb_grpc.EmbeddingServiceStub(channel))
        stream.ask(build_request("demo", {"item": [1]}))

        async def main() -> None:
            async with AsyncHPSClient(target(srv), timeout=30) as client:
                with pytest.raises(LookupError_, match="DEADLINE_EXCEEDED"):
                    await client.lookup("demo", "item", KEYS, timeout=0.3)
                stream.close()
                assert (await client.lookup("demo", "item", KEYS)).shape == (KEYS.shape[0], ITEM_DIM)

        asyncio.run(main())


def test_retries_past_a_replica_cancelling_calls_as_it_shuts_down(replicas: list[HPSServer]) -> None:
    """A pod shutting down may answer CANCELLED; lookups are reads, so both clients go on to the next replica."""
    live = replicas[0]

    def cancel(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.CANCELLED, "the server is shutting down")

    shutting_down = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(cancel)
    shutting_down.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("hps.v1.EmbeddingService", {"Lookup": handler}),))
    port = shutting_down.add_insecure_port("127.0.0.1:0")
    shutting_down.start()
    try:
        cancelling = f"127.0.0.1:{port}"
        with HPSClient([cancelling, target(live)], retries=2, backoff_s=0.01) as client:
            for _ in range(4):
                np.testing.assert_array_equal(client.lookup("demo", "item", KEYS), ROWS)
        with HPSClient([cancelling], retries=1, backoff_s=0.01) as client, pytest.raises(LookupError_) as err:
            client.lookup("demo", "item", KEYS)
        assert "CANCELLED" in str(err.value)

        async def main() -> None:
            async with AsyncHPSClient([cancelling, target(live)], retries=2, backoff_s=0.01, timeout=30) as client:
                for _ in range(4):
                    np.testing.assert_array_equal(await client.lookup("demo", "item", KEYS), ROWS)

        asyncio.run(main())
    finally:
        shutting_down.stop(0)
