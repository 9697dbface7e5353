"""Coalescing in an event loop: :class:`AsyncCoalescingTransport` wraps an
:class:`~hps_client.transport.AsyncTransport`, and small lookups that tasks make together go out as one (see
:mod:`hps_client.coalescing`).

The first lookup of a group leads a batch. With no call of the client in flight it yields to the loop once, so that
the tasks ready to run (``asyncio.gather`` of many lookups) join it, then goes out; otherwise it waits for others
until the window passes, the batch fills its key budget or the calls in flight end. A merged call runs in a task of
its own: a caller cancelled while waiting leaves the batch (before it goes out) or its answer unread (after), and
the others are answered either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any, TypeVar

from hps_client.calls import Call
from hps_client.coalescing import (
    ALONE,
    DEFAULT_MAX_KEYS,
    DEFAULT_WINDOW_S,
    Batch,
    Member,
    check_settings,
    group_of,
    joinable,
    resolved,
)
from hps_client.transport import AsyncTransport

R = TypeVar("R")


class _LoopBatch(Batch):
    __slots__ = ("done", "ready")

    def __init__(self, max_keys: int) -> None:
        super().__init__(max_keys)
        self.done: asyncio.Future[None] | None = None  # made when a second member joins: a lone one awaits nothing
        self.ready: asyncio.Future[None] | None = None  # the leader's wait for others, while calls are in flight

    def release(self) -> None:
        if self.ready is not None and not self.ready.done():
            self.ready.set_result(None)


class AsyncCoalescingTransport:
    """``inner`` with concurrent small lookups of one group merged into one call (``window_s``: how long a lookup
    waits for others while calls are in flight; ``max_keys``: the keys of a merged call at most)."""

    def __init__(self, inner: AsyncTransport, window_s: float = DEFAULT_WINDOW_S,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        check_settings(window_s, max_keys)
        self.inner = inner
        self.window_s = window_s
        self.max_keys = max_keys
        self._pending: dict[Hashable, _LoopBatch] = {}
        self._waiting: set[_LoopBatch] = set()  # batches whose leader waits for the calls in flight
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def handle(self, call: Call[R]) -> R:
        """The answer of ``call``, alone or as part of a merged call."""
        member = joinable(call, self.max_keys)
        if member is None:
            answer: R = await self.inner.handle(call)
            return answer
        key = group_of(member)
        batch = self._pending.get(key)
        if batch is not None and batch.fits(member):
            if batch.done is None:
                batch.done = asyncio.get_running_loop().create_future()
            batch.add(member)
            if batch.sealed:
                batch.release()
            return await self._follow(batch, member)
        batch = self._pending[key] = _LoopBatch(self.max_keys)
        batch.add(member)
        try:
            await self._gather(batch)
        except asyncio.CancelledError:
            batch.remove(member)
            self._go(key, batch)
            raise
        if len(batch.members) == 1:  # nobody joined: the lookup as it is, in the caller's task
            self._unpend(key, batch)
            batch.sent = batch.sealed = True
            self._in_flight += 1
            try:
                answer = await self.inner.handle(call)
            finally:
                self._ended()
            return answer
        self._go(key, batch)
        return await self._follow(batch, member)

    async def _gather(self, batch: _LoopBatch) -> None:
        """Until the others that will join have: the ready tasks (nothing in flight), else the window, a full batch
        or the calls in flight ending."""
        if not self._in_flight:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        batch.ready = loop.create_future()
        timer = loop.call_later(self.window_s, batch.release)
        self._waiting.add(batch)
        try:
            await batch.ready
        finally:
            timer.cancel()
            self._waiting.discard(batch)

    def _unpend(self, key: Hashable, batch: _LoopBatch) -> None:
        if self._pending.get(key) is batch:
            del self._pending[key]

    def _go(self, key: Hashable, batch: _LoopBatch) -> None:
        """Send the batch's merged call in a task of its own (nothing when every member left)."""
        self._unpend(key, batch)
        batch.sealed = True
        if not batch.members:
            return
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: _LoopBatch) -> None:
        try:
            answer = await self.inner.handle(batch.call())
        except BaseException as err:  # settles every member; the task itself ends quietly
            batch.settle(error=err)
        else:
            batch.settle(answer)
        finally:
            self._ended()
            assert batch.done is not None
            batch.done.set_result(None)

    def _ended(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            for waiting in list(self._waiting):
                waiting.release()

    async def _follow(self, batch: _LoopBatch, member: Member) -> Any:
        """The member's outcome once its batch is answered (its own call when it must go alone)."""
        assert batch.done is not None
        try:
            await asyncio.shield(batch.done)
        except asyncio.CancelledError:
            batch.remove(member)
            raise
        if member.outcome is ALONE:
            call: Call[Any] = member.call
            return await self.inner.handle(call)
        return resolved(member)

    async def close(self) -> None:
        await self.inner.close()
