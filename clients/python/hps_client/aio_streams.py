"""The asyncio stream of :class:`~hps_client.AsyncHPSClient` (see :mod:`hps_client.streams`).

grpc.aio reports ``INTERNAL: Internal error from Core`` instead of the server's status when a request is written as
the server ends the stream (grpc/grpc#36066): a refused stream or a failed request could then read as the client's
own fault. After such an ending the stream asks the server again what it would have said, writing nothing that can
race: the request at its head alone (a unary Lookup), then, when that is answered, an empty stream (its admission,
which the stream limits refuse). The first refusal is raised; with none, the INTERNAL error is, naming the race.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import grpc

from hps_client.errors import InternalError
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.routing import remaining
from hps_client.streams import StreamAnswer, StreamOrder, StreamRequest

#: What grpc.aio's debug string says when a write raced the end of the call (grpc/grpc#36066).
WRITE_RACE = 'Failed "execute_batch"'
#: The longest the server is asked again after a write race, each time.
RECHECK_S = 5.0


async def stream_answers_async(stub: Any, requests: Iterable[StreamRequest] | AsyncIterable[StreamRequest],
                               max_in_flight: int, deadline: float | None, **kwargs: Any
                               ) -> AsyncIterator[StreamAnswer]:
    """The answers of ``requests`` (an iterable or an async iterable) over a grpc.aio stub's ``StreamLookup``, in
    order, as :func:`hps_client.streams.stream_answers`."""
    order = StreamOrder()
    slots = asyncio.Semaphore(max_in_flight)
    failed: list[BaseException] = []

    async def outgoing() -> AsyncIterator[pb.LookupRequest]:
        try:
            if isinstance(requests, AsyncIterable):
                async for request in requests:
                    await slots.acquire()
                    yield order.request(request)
            else:
                for request in requests:
                    await slots.acquire()
                    yield order.request(request)
        except Exception as err:  # a bad request, or the caller's iterator failed: the stream ends there
            failed.append(err)

    call = stub.StreamLookup(outgoing(), timeout=remaining(deadline), **kwargs)
    try:
        async for response in call:
            slots.release()
            yield order.answer(response)
    except grpc.aio.AioRpcError as err:
        if not write_race(err):
            raise order.error(err) from None
        hidden = await hidden_status(stub, order.head(), deadline, kwargs)
        if hidden is not None:
            raise order.error(hidden) from None
        raise InternalError(f"{order.error(err)}; a request was written as the stream ended, and grpc.aio hid the "
                            "server's status (grpc/grpc#36066)") from None
    finally:
        call.cancel()
    if failed:
        raise failed[0]


async def hidden_status(stub: Any, head: pb.LookupRequest | None, deadline: float | None,
                        kwargs: dict[str, Any]) -> grpc.aio.AioRpcError | None:
    """The refusal a write race hid: the head request's, asked alone, else an empty stream's; None when the server
    answers both."""
    if head is not None:
        try:
            await stub.Lookup(head, timeout=remaining(deadline, RECHECK_S), **kwargs)
        except grpc.aio.AioRpcError as err:
            return err
    try:
        async for _ in stub.StreamLookup(iter(()), timeout=remaining(deadline, RECHECK_S), **kwargs):
            pass
    except grpc.aio.AioRpcError as err:
        if not write_race(err):
            return err
    return None


def write_race(err: grpc.aio.AioRpcError) -> bool:
    """Whether grpc.aio put its INTERNAL in place of the call's status after a write (grpc/grpc#36066)."""
    return err.code() == grpc.StatusCode.INTERNAL and WRITE_RACE in (err.debug_error_string() or "")
