"""Lookups over one ``StreamLookup`` call: each request checked and numbered as it is sent, at most ``max_in_flight``
sent ahead of their answers, each answer checked to be the next one asked (the server answers a stream in order,
its ``request_id`` echoed). A failure ends the stream: the answers before it are read, then it is raised.

The server bounds its streams (``server.max_streams``, ``server.max_streams_per_caller``); a stream past either
is refused at once, which raises :class:`~hps_client.errors.StreamLimitError`.

This module holds what both clients share and the blocking stream; :mod:`hps_client.aio_streams` the asyncio one.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from hps_client.errors import HPSError, InternalError, InvalidArgumentError, StreamLimitError, error_for
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.routing import remaining
from hps_client.rows import StoredAnswer
from hps_client.wire import TableAnswer, WireResponse, as_keys, build_request, decode_answer, decode_stored

#: Requests a stream sends ahead of their answers unless the caller says otherwise.
DEFAULT_IN_FLIGHT = 64


@dataclass(slots=True)
class StreamRequest:
    """One lookup of a stream: tables of one model, its ``version`` or ``label``, float32 rows or ``stored`` ones;
    ``request_id`` (None: the client numbers requests 1, 2, ... in the order sent) comes back with its answer."""

    model: str
    tables: Mapping[str, np.ndarray | Sequence[int]]
    version: int | None = None
    label: str = ""
    stored: bool = False
    request_id: int | None = None


@dataclass(slots=True)
class StreamAnswer:
    """The answer of one request of a stream: ``tables`` as :meth:`~hps_client.HPSClient.lookup_many` answers
    them (``{table: StoredAnswer}`` for a ``stored`` request), from the model's ``version``."""

    request_id: int
    model: str
    version: int
    tables: dict[str, TableAnswer | StoredAnswer]


class StreamOrder:
    """The requests of one stream as they go out, and its answers checked against them."""

    def __init__(self) -> None:
        self._next_id = 1
        self._asked: deque[tuple[int, bool, tuple[str, ...], pb.LookupRequest]] = deque()

    def request(self, request: StreamRequest) -> pb.LookupRequest:
        """The message of ``request``, checked; InvalidArgumentError naming what is wrong."""
        if not isinstance(request, StreamRequest):
            raise InvalidArgumentError(f"a stream takes StreamRequest objects, got {type(request).__name__}")
        if not request.model:
            raise InvalidArgumentError("model name is empty")
        if not request.tables:
            raise InvalidArgumentError("the request names no table")
        request_id = self._next_id if request.request_id is None else request.request_id
        if not 0 <= request_id < 2**64:
            raise InvalidArgumentError(f"request_id {request_id} is not a uint64")
        self._next_id = request_id + 1
        tables = {name: as_keys(keys) for name, keys in request.tables.items()}
        message = build_request(request.model, tables, pb.PRECISION_STORED if request.stored else pb.PRECISION_FP32,
                                request.version, request.label)
        message.request_id = request_id
        self._asked.append((request_id, request.stored, tuple(tables), message))
        return message

    def head(self) -> pb.LookupRequest | None:
        """The first request not answered yet."""
        return self._asked[0][3] if self._asked else None

    def answer(self, response: WireResponse) -> StreamAnswer:
        """The next answer, decoded; InternalError when it is not the one asked next."""
        if not self._asked:
            raise InternalError(f"the server answered request {response.request_id}, which was not asked")
        request_id, stored, tables, _ = self._asked.popleft()
        got = tuple(tv.table for tv in response.tables)
        if response.request_id != request_id or got != tables:
            raise InternalError(f"the stream answered request {response.request_id} (tables {list(got)}) where "
                                f"request {request_id} (tables {list(tables)}) was next")
        decode = decode_stored if stored else decode_answer
        return StreamAnswer(request_id, response.model, response.version,
                            {tv.table: decode(tv) for tv in response.tables})

    def error(self, err: grpc.RpcError) -> HPSError:
        """What ended the stream, naming the request it ended at; StreamLimitError for the server's refusal."""
        code, details = err.code(), err.details() or ""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "server.max_streams" in details:
            return StreamLimitError(f"the server refused the stream: {details}", code=code, details=details)
        if self._asked:
            details = f"{details} (stream request {self._asked[0][0]})"
        return error_for(code, details)


def check_in_flight(max_in_flight: int) -> int:
    if max_in_flight < 1:
        raise InvalidArgumentError(f"max_in_flight must be >= 1, got {max_in_flight}")
    return max_in_flight


def stream_answers(method: Callable[..., Any], requests: Iterable[StreamRequest] | AsyncIterable[StreamRequest],
                   max_in_flight: int, deadline: float | None, **kwargs: Any) -> Iterator[StreamAnswer]:
    """The answers of ``requests`` over ``method`` (a sync ``StreamLookup`` callable), in order."""
    if not isinstance(requests, Iterable):
        raise InvalidArgumentError("HPSClient.lookup_stream takes an iterable of requests (an async iterable: use "
                                   "AsyncHPSClient)")
    order = StreamOrder()
    slots = threading.Semaphore(max_in_flight)
    ended = threading.Event()
    failed: list[BaseException] = []

    def outgoing() -> Iterator[pb.LookupRequest]:  # on gRPC's thread
        try:
            for request in requests:
                while not slots.acquire(timeout=0.1):
                    if ended.is_set():
                        return
                if ended.is_set():
                    return
                yield order.request(request)
        except Exception as err:  # a bad request, or the caller's iterator failed: the stream ends there
            failed.append(err)

    responses = method(outgoing(), timeout=remaining(deadline), **kwargs)
    try:
        for response in responses:
            slots.release()
            yield order.answer(response)
    except grpc.RpcError as err:
        raise order.error(err) from None
    finally:
        ended.set()
        responses.cancel()
    if failed:
        raise failed[0]
