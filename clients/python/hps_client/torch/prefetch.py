"""Lookups started ahead: ``prefetch`` looks batch N+1's rows up on a background thread while batch N's dense
compute runs, and the next forward with equal inputs takes those rows instead of looking them up again. On a CUDA
device the rows are copied on a side stream, which the consuming call's stream waits for."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

#: Prefetches a source keeps pending (older ones nobody consumed are dropped).
KEEP = 8
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_STREAMS = threading.local()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hps-prefetch")
        return _POOL


def _side_stream(device: torch.device) -> Any:
    """This thread's copy stream on ``device``."""
    streams = getattr(_STREAMS, "by_device", None)
    if streams is None:
        streams = _STREAMS.by_device = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


class Prefetch:
    """A lookup started ahead of the forward that will consume it: ``done()``, ``wait()`` for its rows."""

    def __init__(self, key: Hashable, given: tuple[torch.Tensor | None, ...], inputs: tuple[torch.Tensor | None, ...],
                 future: Future[tuple[torch.Tensor, Any]]) -> None:
        self.key = key
        #: The caller's tensors and their version counters: the same tensors unchanged match at once.
        self._given = given
        self._versions = tuple(None if t is None else t._version for t in given)
        #: Copies of the inputs, which the lookup reads and other tensors of equal values match.
        self.inputs = inputs
        self._future = future
        #: Whether a forward took its rows.
        self.consumed = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The rows (the lookup's error, if it failed), ready for use on the calling thread's current stream."""
        rows, event = self._future.result(timeout)
        if event is not None:
            stream = torch.cuda.current_stream(rows.device)
            stream.wait_event(event)
            rows.record_stream(stream)
        return rows

    def matches(self, key: Hashable, inputs: tuple[torch.Tensor | None, ...]) -> bool:
        if self.key != key or len(inputs) != len(self.inputs):
            return False
        if all(a is b and (a is None or a._version == v) for a, b, v in zip(inputs, self._given, self._versions)):
            return True
        return all(_same(a, b) for a, b in zip(inputs, self.inputs))


class Prefetches:
    """A source's pending prefetches, newest last."""

    def __init__(self) -> None:
        self._pending: deque[Prefetch] = deque(maxlen=KEEP)
        self._lock = threading.Lock()
        #: Forwards answered from a prefetch.
        self.hits = 0

    def start(self, key: Hashable, inputs: tuple[torch.Tensor | None, ...],
              lookup: Callable[..., torch.Tensor], device: torch.device) -> Prefetch:
        """Run ``lookup(*copies of inputs)`` in the background; the handle a later :meth:`take` consumes."""
        copies = tuple(None if t is None else t.detach().clone() for t in inputs)

        def run() -> tuple[torch.Tensor, Any]:
            if device.type != "cuda":
                return lookup(*copies), None
            stream = _side_stream(device)
            with torch.cuda.stream(stream):
                rows = lookup(*copies)
                event = torch.cuda.Event()
                event.record(stream)
            return rows, event

        handle = Prefetch(key, inputs, copies, _pool().submit(run))
        with self._lock:
            self._pending.append(handle)
        return handle

    def take(self, key: Hashable, inputs: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
        """The rows of the oldest pending prefetch of these inputs (waiting for it), or None when there is none."""
        if not self._pending:
            return None
        with self._lock:
            found = next((p for p in self._pending if p.matches(key, inputs)), None)
            if found is None:
                return None
            self._pending.remove(found)
            found.consumed = True
            self.hits += 1
        return found.wait()
