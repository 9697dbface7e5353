"""Coalescing across threads: :class:`CoalescingTransport` wraps a :class:`~hps_client.transport.Transport`, and
small lookups that threads make while the client has calls in flight go out as one (see
:mod:`hps_client.coalescing`).

With no call of the client in flight a lookup goes out at once, alone (a lone lookup waits for nothing). Otherwise
the first lookup of a group leads a batch: it waits for others to join until the window passes, the batch fills its
key budget or the calls in flight end, then makes the call in its thread and hands each follower its part.
"""

from __future__ import annotations

import threading
import time
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
from hps_client.transport import Transport

R = TypeVar("R")


class _ThreadBatch(Batch):
    __slots__ = ("done",)

    def __init__(self, max_keys: int) -> None:
        super().__init__(max_keys)
        self.done = threading.Event()


class CoalescingTransport:
    """``inner`` with concurrent small lookups of one group merged into one call (``window_s``: how long a lookup
    waits for others while calls are in flight; ``max_keys``: the keys of a merged call at most)."""

    def __init__(self, inner: Transport, window_s: float = DEFAULT_WINDOW_S,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        check_settings(window_s, max_keys)
        self.inner = inner
        self.window_s = window_s
        self.max_keys = max_keys
        self._cond = threading.Condition()
        self._pending: dict[Hashable, _ThreadBatch] = {}
        self._in_flight = 0

    def handle(self, call: Call[R]) -> R:
        """The answer of ``call``, alone or as part of a merged call."""
        member = joinable(call, self.max_keys)
        if member is None:
            return self.inner.handle(call)
        with self._cond:
            alone = not self._in_flight and not self._pending
            if alone:
                self._in_flight += 1
        if alone:  # nothing to wait for: at once, and counted in flight so that lookups meanwhile batch up
            try:
                return self.inner.handle(call)
            finally:
                self._ended()
        key = group_of(member)
        with self._cond:
            batch = self._pending.get(key)
            lead = batch is None or not batch.fits(member)
            if lead:
                batch = self._pending[key] = _ThreadBatch(self.max_keys)
            assert batch is not None
            batch.add(member)
            if batch.sealed:
                self._cond.notify_all()
            if lead:
                self._gather(batch)
                if self._pending.get(key) is batch:
                    del self._pending[key]
                batch.sealed = True
                self._in_flight += 1
        if lead:
            self._send(batch)
        else:
            batch.done.wait()
        return self._own(member)

    def _gather(self, batch: Batch) -> None:
        """Wait (the lock held) while calls are in flight, until the batch is full or the window passed."""
        end = time.monotonic() + self.window_s
        while not batch.sealed and self._in_flight:
            left = end - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _send(self, batch: _ThreadBatch) -> None:
        try:
            answer = self.inner.handle(batch.call())
        except BaseException as err:  # every member's outcome, the leader's included (re-raised by it)
            batch.settle(error=err)
        else:
            batch.settle(answer)
        finally:
            self._ended()
            batch.done.set()

    def _ended(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def _own(self, member: Member) -> Any:
        if member.outcome is ALONE:
            call: Call[Any] = member.call
            return self.inner.handle(call)
        return resolved(member)

    def close(self) -> None:
        self.inner.close()
