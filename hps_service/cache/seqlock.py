"""A sequence lock: lookups read the cache without taking any lock, mutations serialize on a mutex.

A writer bumps :attr:`SeqLock.sequence` to odd before it changes the cache and back to even after.
A reader notes the sequence, runs, and keeps its answer only if the sequence was even and unchanged;
otherwise it runs again holding the mutex, so it waits for the writer instead of spinning and can
never starve. Readers must be harmless to run against a half-written cache (the compiled probe only
reads in-bounds slots and writes its own outputs), because they may overlap a writer; the check
afterwards is what guarantees that an answer kept never mixes two states.

The GIL orders the sequence reads and writes with the GIL-free kernels between them: a reader's
kernel finishes before its second read of the sequence, and a writer's change starts after its
first bump, so an unchanged even sequence means no change overlapped the read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class SeqLock:
    """Lock-free optimistic readers, one writer at a time."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self.sequence = 0

    def read(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` as of one consistent state of the protected data (run again locked if a writer overlapped)."""
        before = self.sequence
        if not before & 1:
            result = fn(*args)
            if self.sequence == before:
                return result
        with self._mutex:
            return fn(*args)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold off writers (not lock-free readers) for the body: for reads that must not be repeated."""
        with self._mutex:
            yield

    @contextmanager
    def write(self) -> Iterator[None]:
        """Change the protected data in the body; overlapping lock-free reads are discarded and rerun."""
        with self._mutex:
            self.sequence += 1
            try:
                yield
            finally:
                self.sequence += 1
