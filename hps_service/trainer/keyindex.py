"""An int64 key -> int32 slot index for the trainer's embedding tables: open addressing, compiled batch kernels.

Linear probing from a splitmix64 hash of the key over a power-of-two array of (key, slot) pairs; removal shifts
the rest of the probe run back, so no tombstones accumulate. Every operation takes a whole batch of keys and
loops inside numba; the index grows by rehashing when it passes half full.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hps_service.jit.hashing import mix64

_EMPTY = np.int32(-1)


@njit(cache=True, nogil=True, inline="always")
def _home(key: np.int64, mask: np.int64) -> np.int64:
    return np.int64(mix64(np.uint64(key)) & np.uint64(mask))


@njit(cache=True, nogil=True)
def _find(keys_at: np.ndarray, slots_at: np.ndarray, keys: np.ndarray, out: np.ndarray) -> None:
    mask = np.int64(keys_at.shape[0] - 1)
    for i in range(keys.shape[0]):
        key = keys[i]
        pos = _home(key, mask)
        out[i] = -1
        while slots_at[pos] >= 0:
            if keys_at[pos] == key:
                out[i] = slots_at[pos]
                break
            pos = (pos + 1) & mask


@njit(cache=True, nogil=True)
def _insert(keys_at: np.ndarray, slots_at: np.ndarray, keys: np.ndarray, slots: np.ndarray) -> None:
    """Insert keys that are not present (the caller guarantees it) with the given slots."""
    mask = np.int64(keys_at.shape[0] - 1)
    for i in range(keys.shape[0]):
        pos = _home(keys[i], mask)
        while slots_at[pos] >= 0:
            pos = (pos + 1) & mask
        keys_at[pos] = keys[i]
        slots_at[pos] = slots[i]


@njit(cache=True, nogil=True)
def _remove(keys_at: np.ndarray, slots_at: np.ndarray, keys: np.ndarray) -> None:
    mask = np.int64(keys_at.shape[0] - 1)
    for i in range(keys.shape[0]):
        key = keys[i]
        pos = _home(key, mask)
        found = False
        while slots_at[pos] >= 0:
            if keys_at[pos] == key:
                found = True
                break
            pos = (pos + 1) & mask
        if not found:
            continue
        hole = pos
        j = pos
        while True:  # backward-shift deletion
            j = (j + 1) & mask
            if slots_at[j] < 0:
                break
            home = _home(keys_at[j], mask)
            if hole <= j:
                stays = hole < home <= j
            else:
                stays = home > hole or home <= j
            if stays:
                continue
            keys_at[hole] = keys_at[j]
            slots_at[hole] = slots_at[j]
            hole = j
        slots_at[hole] = -1


class KeyIndex:
    """Maps distinct int64 keys to int32 slots chosen by the caller."""

    def __init__(self, capacity: int = 1024) -> None:
        size = 16
        while size < 2 * max(capacity, 1):
            size *= 2
        self._keys = np.zeros(size, dtype=np.int64)
        self._slots = np.full(size, _EMPTY, dtype=np.int32)
        self.count = 0

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of every key, -1 where absent."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        out = np.empty(keys.shape[0], dtype=np.int32)
        _find(self._keys, self._slots, keys, out)
        return out

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Add distinct keys that are not present, each with its slot."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if 2 * (self.count + keys.shape[0]) > self._keys.shape[0]:
            self._grow(self.count + keys.shape[0])
        _insert(self._keys, self._slots, keys, np.ascontiguousarray(slots, dtype=np.int32))
        self.count += int(keys.shape[0])

    def remove(self, keys: np.ndarray) -> None:
        """Drop present keys (absent ones are ignored by the kernel but must not be counted by the caller)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        _remove(self._keys, self._slots, keys)
        self.count -= int(keys.shape[0])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (key, slot) held, in no particular order."""
        live = self._slots >= 0
        return self._keys[live].copy(), self._slots[live].copy()

    def _grow(self, needed: int) -> None:
        live = self._slots >= 0
        keys, slots = self._keys[live], self._slots[live]
        size = self._keys.shape[0]
        while size < 2 * needed:
            size *= 2
        self._keys = np.zeros(size, dtype=np.int64)
        self._slots = np.full(size, _EMPTY, dtype=np.int32)
        _insert(self._keys, self._slots, keys, slots)
