"""Streams with no message either way for ``server.stream_idle_timeout_s`` are closed, with DEADLINE_EXCEEDED and a
message naming the key: an idle stream would otherwise hold its slot (and, for a blocking method, its thread) for as
long as the connection lives. One thread per serving process looks at the open streams, only while there are any."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

log = logging.getLogger(__name__)

#: The status an idle stream is closed with.
IDLE_STATUS = grpc.StatusCode.DEADLINE_EXCEEDED


def close_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from outside its handler, its client getting ``code`` and ``details``. gRPC's sync server offers
    only ``context.cancel()`` for that (the client sees CANCELLED, no reason); its core call, under the context (and
    under an interceptor's wrapper, which passes attributes through), takes a status of our choosing."""
    call: Any = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        call.cancel(code.value[0], details)
    else:
        context.cancel()


class Watched:
    """One open stream: when a message last went either way."""

    __slots__ = ("context", "last")

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.last = time.monotonic()

    def touch(self) -> None:
        """A message went either way."""
        self.last = time.monotonic()

    def requests(self, requests: Iterator[Any]) -> Iterator[Any]:
        """``requests``, each one touching the stream as it arrives."""
        for request in requests:
            self.touch()
            yield request


class IdleStreams:
    """Closes the streams it watches once they have been idle for ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._open: set[Watched] = set()
        self._running = False
        self.closed = 0

    def watch(self, context: grpc.ServicerContext) -> Watched:
        """Watch the stream of ``context`` from now until :meth:`forget`."""
        watched = Watched(context)
        with self._cond:
            self._open.add(watched)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="hps-stream-idle", daemon=True).start()
        return watched

    def forget(self, watched: Watched) -> None:
        """The stream ended."""
        with self._cond:
            self._open.discard(watched)

    def _run(self) -> None:
        tick = min(1.0, self.timeout_s / 4)
        while True:
            with self._cond:
                if not self._open:
                    self._running = False
                    return
                self._cond.wait(tick)
                cutoff = time.monotonic() - self.timeout_s
                idle = [w for w in self._open if w.last <= cutoff]
                self._open.difference_update(idle)
                self.closed += len(idle)
            for watched in idle:
                log.debug("closing a stream of %s idle for %.0f s", watched.context.peer(), self.timeout_s)
                close_call(watched.context, IDLE_STATUS, f"no message on this stream for {self.timeout_s:g} s "
                           f"(server.stream_idle_timeout_s): closed; open a new one when there is something to send")
