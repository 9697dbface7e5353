"""A bounded log of the keys that online updates and deletes touched, by generation.

Rows read from the lower tiers before an update must not be written into the cache after it (they
would bring back the old value). Deferred admission, refresh and warm start note the generation
before they read, and drop the keys changed since then before they write.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class ChangeLog:
    """Generations of update/invalidate batches; callers serialise access (the cache's write lock).

    Bounded by batches and by keys held (an import invalidates in chunks of 65,536 keys): what is forgotten only
    makes :meth:`changed_since` answer None for older generations, and such reads are then not written at all.
    """

    def __init__(self, max_batches: int = 4096, max_keys: int = 1 << 20) -> None:
        self._entries: deque[tuple[int, np.ndarray]] = deque()
        self._max_batches = max_batches
        self._max_keys = max_keys
        self._held = 0
        self._generation = 0
        self._forgotten_through = 0
        self._mirror: tuple[np.ndarray, int] | None = None

    def mirror_to(self, array: np.ndarray, index: int) -> None:
        """Also write the generation to ``array[index]`` after every change (and now): how readers in other
        processes learn it. A reader may see it late, never ahead, which only makes its checks stricter."""
        self._mirror = (array, index)
        array[index] = self._generation

    def _published(self) -> None:
        if self._mirror is not None:
            self._mirror[0][self._mirror[1]] = self._generation

    @property
    def generation(self) -> int:
        """The generation of the newest recorded change (0: none yet)."""
        return self._generation

    def record(self, keys: np.ndarray) -> None:
        """Note that ``keys`` changed now."""
        self._generation += 1
        entry = np.array(keys, dtype=np.int64, copy=True)
        self._entries.append((self._generation, entry))
        self._held += entry.shape[0]
        while len(self._entries) > self._max_batches or (self._held > self._max_keys and len(self._entries) > 1):
            generation, forgotten = self._entries.popleft()
            self._forgotten_through = generation
            self._held -= forgotten.shape[0]
        self._published()

    def record_all(self) -> None:
        """Note that every key changed now (a clear): anything read before is stale."""
        self._generation += 1
        self._entries.clear()
        self._held = 0
        self._forgotten_through = self._generation
        self._published()

    def changed_since(self, generation: int, keys: np.ndarray) -> np.ndarray | None:
        """Mask of ``keys`` changed after ``generation``; None when the log no longer reaches back."""
        if generation < self._forgotten_through:
            return None
        changed = np.zeros(keys.shape[0], dtype=bool)
        if generation == self._generation:
            return changed
        newer = [k for g, k in self._entries if g > generation]
        if newer:
            changed |= np.isin(keys, np.concatenate(newer))
        return changed
