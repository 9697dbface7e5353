"""lookup_stream on both clients against a real server: answers in order with their request ids, at most
max_in_flight requests ahead of their answers, a failed request ending the stream after the answers before it, a
deadline over the whole stream, and the server's stream limits raised as StreamLimitError."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_client import (
    AsyncHPSClient,
    DeadlineExceededError,
    HPSClient,
    InvalidArgumentError,
    NotFoundError,
    StoredAnswer,
    StreamAnswer,
    StreamLimitError,
    StreamRequest,
)
from hps_client.aio_streams import hidden_status
from hps_client.stub import EmbeddingStub
from hps_client.wire import build_request
from hps_service.serve.process import HPSServer
from tests.server.conftest import AUTH, ITEM_DIM, USER_DIM, base_url, running, server_config, target

KEYS = np.arange(1, 201, dtype=np.int64)


def rows(keys: np.ndarray | list[int], dim: int = ITEM_DIM) -> np.ndarray:
    return np.repeat(np.asarray(keys, dtype=np.float32)[:, None], dim, axis=1)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    with running(server_config(tmp_path_factory.mktemp("streams"), workers=0, max_streams=2,
                               max_streams_per_caller=2)) as s:
        for table, dim in (("item", ITEM_DIM), ("user", USER_DIM)):
            r = httpx.put(f"{base_url(s)}/v1/models/demo/tables/{table}/embeddings", headers=AUTH, timeout=30,
                          json={"keys": KEYS.tolist(), "vectors": rows(KEYS, dim).tolist(), "version": 1})
            assert r.status_code == 200, r.text
        yield s


def _requests() -> list[StreamRequest]:
    asks = [StreamRequest("demo", {"item": [k, k + 1]}) for k in range(1, 101)]
    asks[10] = StreamRequest("demo", {"item": [5], "user": [6, 7]}, request_id=1000)
    asks[20] = StreamRequest("demo", {"user": [8]}, stored=True)
    return asks


def _check(answers: list[StreamAnswer]) -> None:
    assert [a.request_id for a in answers] == [*range(1, 11), *range(1000, 1090)]
    for i, answer in enumerate(answers):
        assert answer.model == "demo" and answer.version == 0
        if i == 10:
            assert list(answer.tables) == ["item", "user"]
            np.testing.assert_array_equal(answer.tables["user"].vectors, rows([6, 7], USER_DIM))
        elif i == 20:
            stored = answer.tables["user"]
            assert isinstance(stored, StoredAnswer)
            np.testing.assert_array_equal(stored.rows.to_float32(), rows([8], USER_DIM))
        else:
            np.testing.assert_array_equal(answer.tables["item"].vectors, rows([i + 1, i + 2]))


def test_answers_come_in_order_with_their_request_ids(srv: HPSServer) -> None:
    with HPSClient(target(srv)) as client:
        _check(list(client.lookup_stream(_requests(), max_in_flight=4)))

    async def run() -> list[StreamAnswer]:
        async def asks() -> AsyncIterator[StreamRequest]:
            for request in _requests():
                yield request

        async with AsyncHPSClient(target(srv)) as client:
            return [answer async for answer in client.lookup_stream(asks(), max_in_flight=4)]

    _check(asyncio.run(run()))


def test_requests_in_flight_are_bounded(srv: HPSServer) -> None:
    """A slow reader: the stream reads its requests no further than max_in_flight past the last answer read."""
    pulled: list[int] = []

    def asks() -> Iterator[StreamRequest]:
        for k in range(1, 41):
            pulled.append(k)
            yield StreamRequest("demo", {"item": [k]})

    ahead = []
    with HPSClient(target(srv)) as client:
        for i, answer in enumerate(client.lookup_stream(asks(), max_in_flight=3), 1):
            assert answer.request_id == i
            time.sleep(0.01)
            ahead.append(len(pulled) - i)
    assert max(ahead) <= 4 and max(ahead) >= 3  # 3 sent ahead, and the next one read, waiting for room

    async def run() -> list[int]:
        pulled.clear()
        seen = []
        async with AsyncHPSClient(target(srv)) as client:
            i = 0
            async for _ in client.lookup_stream(asks(), max_in_flight=3):
                i += 1
                await asyncio.sleep(0.01)
                seen.append(len(pulled) - i)
        return seen

    seen = asyncio.run(run())
    assert max(seen) <= 4 and max(seen) >= 3


def test_a_failed_request_ends_the_stream_after_the_answers_before_it(srv: HPSServer) -> None:
    good = [StreamRequest("demo", {"item": [k]}) for k in range(1, 4)]
    missing = [*good, StreamRequest("demo", {"nope": [1]}), *good]
    malformed = [*good[:2], StreamRequest("demo", {"item": [1.5]}), *good]
    with HPSClient(target(srv)) as client:
        answers = []
        with pytest.raises(NotFoundError, match=r"no table 'nope'.*\(stream request 4\)"):
            for answer in client.lookup_stream(missing):
                answers.append(answer.request_id)
        assert answers == [1, 2, 3]
        answers.clear()
        with pytest.raises(InvalidArgumentError, match="keys must be integers"):
            for answer in client.lookup_stream(malformed):
                answers.append(answer.request_id)
        assert answers == [1, 2]
        with pytest.raises(InvalidArgumentError, match="max_in_flight"):
            client.lookup_stream(good, max_in_flight=0)

    async def run() -> list[int]:
        got = []
        async with AsyncHPSClient(target(srv)) as client:
            with pytest.raises(NotFoundError, match="stream request 4"):
                async for answer in client.lookup_stream(missing):
                    got.append(answer.request_id)
        return got

    assert asyncio.run(run()) == [1, 2, 3]


class _Held:
    """A stream whose requests come from a queue: open (answered once) until :meth:`close`."""

    def __init__(self, client: HPSClient) -> None:
        self._feed: queue.Queue[StreamRequest | None] = queue.Queue()
        self.answers = client.lookup_stream(iter(self._feed.get, None))
        self._feed.put(StreamRequest("demo", {"item": [1]}))
        assert next(self.answers).request_id == 1

    def close(self) -> None:
        self._feed.put(None)
        assert list(self.answers) == []


def test_the_servers_stream_limits_are_a_clear_error(srv: HPSServer, tmp_path: Path) -> None:
    ask = [StreamRequest("demo", {"item": [1]})]
    with HPSClient(target(srv)) as client:
        held = [_Held(client), _Held(client)]
        with pytest.raises(StreamLimitError, match=r"the server refused the stream: .*server\.max_streams=2"):
            list(client.lookup_stream(ask))

        async def refused() -> None:
            async with AsyncHPSClient(target(srv)) as aclient:
                with pytest.raises(StreamLimitError, match="server.max_streams=2"):
                    async for _ in aclient.lookup_stream(ask):
                        pass
            # what the stream asks after grpc.aio hid a status (grpc/grpc#36066): the head alone, then admission
            async with grpc.aio.insecure_channel(target(srv)) as channel:
                stub = EmbeddingStub(channel)
                missing = await hidden_status(stub, build_request("demo", {"nope": [1]}), None, {})
                assert missing is not None and missing.code() == grpc.StatusCode.NOT_FOUND
                full = await hidden_status(stub, build_request("demo", {"item": [1]}), None, {})
                assert full is not None and "server.max_streams=2" in (full.details() or "")

        asyncio.run(refused())
        for stream in held:
            stream.close()
        deadline = time.monotonic() + 10
        while True:  # the server frees a slot once it sees the stream end
            try:
                assert [a.request_id for a in client.lookup_stream(ask)] == [1]
                break
            except StreamLimitError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    with running(server_config(tmp_path, workers=0, max_streams=8, max_streams_per_caller=1)) as one, \
            HPSClient(target(one)) as client:
        first = _Held(client)
        with pytest.raises(StreamLimitError, match=r"server\.max_streams_per_caller=1"):
            list(client.lookup_stream(ask))
        first.close()


def test_a_deadline_bounds_the_whole_stream(srv: HPSServer) -> None:
    feed: queue.Queue[StreamRequest | None] = queue.Queue()
    feed.put(StreamRequest("demo", {"item": [1]}))
    got = []
    started = time.monotonic()
    with HPSClient(target(srv)) as client, pytest.raises(DeadlineExceededError):
        for answer in client.lookup_stream(iter(feed.get, None), timeout=0.5):
            got.append(answer.request_id)
    assert got == [1] and 0.4 < time.monotonic() - started < 5
    feed.put(None)
