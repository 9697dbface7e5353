"""A sequence lock whose counter is an array element: lookups take no lock, mutations serialize on a mutex.

The counter lives in the cache's ``meta`` array (:mod:`hps_service.cache.layout`), so readers in other
processes that map the same memory see it too. A writer bumps it to odd before it changes the cache and
back to even after (compiled full barriers, :func:`cpu_kernels.seq_begin` / :func:`cpu_kernels.seq_end`).
A reader notes the counter, reads, and keeps its answer only if the counter was even and unchanged
(the compiled query does this check itself, with acquire ordering). Readers must be harmless to run
against a half-written cache (the compiled probe only reads in-bounds slots and writes its own outputs),
because they may overlap a writer; the check afterwards is what guarantees that an answer kept never mixes
two states. A reader of the writer's own process that keeps losing to writers reruns holding the mutex,
so it waits for the writer instead of spinning and can never starve.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import numpy as np

from hps_service.cache import cpu_kernels
from hps_service.cache.layout import META_LEN, META_SEQ

T = TypeVar("T")


class SeqLock:
    """Lock-free optimistic readers, one writer at a time; the counter is ``meta[META_SEQ]``."""

    def __init__(self, meta: np.ndarray | None = None) -> None:
        self._mutex = threading.Lock()
        self.meta = np.zeros(META_LEN, dtype=np.int64) if meta is None else meta

    @property
    def sequence(self) -> int:
        """The counter: odd while a writer is changing the data."""
        return int(self.meta[META_SEQ])

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
        with self._mutex, self.changing():
            yield

    @contextmanager
    def changing(self) -> Iterator[None]:
        """Inside :meth:`exclusive`: the body changes the protected data, so lock-free reads that overlap it are
        rerun. A writer prepares its change before this (readers carry on meanwhile) and makes it here: every
        microsecond the counter stays odd is one in which every reader's work is thrown away."""
        if not self._mutex.locked():
            raise RuntimeError("SeqLock.changing() outside exclusive()")
        cpu_kernels.seq_begin(self.meta)
        try:
            yield
        finally:
            cpu_kernels.seq_end(self.meta)
