"""What the writers of one table share, and what tells a reader which keys were written since it read.

Writers (updates, deletes, imports) of a table hold its ``lock`` from their first tier write to their last, so two
writes never interleave across the tiers (each tier then sees them in the same order). Readers never take it.
Instead, each write stamps the slots of its keys (a hash of the key) with ``WRITING`` before its first tier write and
with a new generation after its last. A reader that copies rows it read from L3 into L2 (promotion, preload,
outage repair) notes the generation before the read and leaves out keys whose slot is stamped above it, so a row
read before a write can never land in L2 after it, whether or not L2 still holds the write's row or tombstone.
A collision only leaves a row out of L2 (a later read promotes it). The guard of a table is kept when its model is
replaced or reloaded, so writes and reads of the old and new tables see each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

#: The stamp of a slot while a write of one of its keys is in progress (above every generation).
WRITING = np.iinfo(np.int64).max
#: Slots per table: 512 KiB of stamps; a write of a few thousand keys marks well under 1% of them.
SLOT_BITS = 16
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class WriteGuard:
    """The write lock and the write stamps of one table (see the module docstring)."""

    def __init__(self, slot_bits: int = SLOT_BITS) -> None:
        self.lock = threading.Lock()
        self._stamps = np.zeros(1 << slot_bits, dtype=np.int64)
        self._shift = np.uint64(64 - slot_bits)
        self._generation = 0
        self._stamp_lock = threading.Lock()
        self._mirror: tuple[np.ndarray, int] | None = None

    def mirror_to(self, array: np.ndarray, index: int) -> None:
        """Also keep ``array[index]`` at the generation (and set it now): where readers in other processes (a
        node's workers) read it before they read rows. It is written after the stamps, so it is never ahead."""
        with self._stamp_lock:
            self._mirror = (array, index)
            array[index] = self._generation

    @property
    def generation(self) -> int:
        """Read before reading rows; pass to :meth:`changed_since` before writing them into L2."""
        return self._generation

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64) * _GOLDEN) >> self._shift).astype(
                np.intp)

    @contextmanager
    def writing(self, keys: np.ndarray) -> Iterator[None]:
        """Stamp ``keys`` as being written for the duration of the block (call with ``lock`` held)."""
        slots = self._slots(keys)
        with self._stamp_lock:
            self._stamps[slots] = WRITING
        try:
            yield
        finally:
            with self._stamp_lock:
                self._generation += 1
                self._stamps[slots] = self._generation
                if self._mirror is not None:
                    self._mirror[0][self._mirror[1]] = self._generation

    def changed_since(self, generation: int, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` a write touched (or is touching) after ``generation``; may include a few others."""
        changed: np.ndarray = self._stamps[self._slots(keys)] > generation
        return changed
