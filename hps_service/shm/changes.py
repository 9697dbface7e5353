"""The keys recently written to RocksDB per table, so that a reader of a secondary instance knows which keys its
view may hold stale.

A RocksDB secondary instance sees the primary's writes only after a catch-up, which costs 1-2 ms even when
nothing changed: too much per lookup. The owner appends the keys of every write batch to a ring *after* the batch
reached RocksDB and then advances the ring's position; a reader notes the position before each catch-up. When it
is about to read keys from its instance, the keys appended since its last catch-up are the only ones it may see
stale: if none of its keys is among them, its answer is current; otherwise (or when the ring lapped its position)
it catches up first. A write whose keys are not appended yet has not been acknowledged to anybody, so missing it
is allowed.

An append overwrites the ring's oldest slots, which a reader may be scanning as part of its window. So the writer
first publishes how far it is about to write (the reservation, ``ctrl[at + 1]``), then copies the keys, then
advances the position (``ctrl[at]``), with release fences between; a reader loads the position, scans its window,
then (after an acquire fence) loads the reservation: a window the reservation reaches into may have been
overwritten while it was scanned, and counts as lapped. Without the reservation a reader whose window was being
overwritten saw neither its key nor a lap.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from hps_service.jit.atomic import acquire_fence, atomic_fetch_add, atomic_load, release_fence

#: Keys remembered per table (512 KiB): at 100k written keys/s, 0.6 s of writes, far beyond a catch-up period
#: (``persistent.change_ring_keys``).
RING_KEYS = 1 << 16


@numba.njit(cache=True, nogil=True)
def _position(ctrl: np.ndarray, at: int) -> np.int64:
    return atomic_load(ctrl, at)


@numba.njit(cache=True, nogil=True)
def _reserve(ctrl: np.ndarray, at: int, by: int) -> None:
    """Publish that the slots of the next ``by`` positions are about to be written, before any of them is."""
    atomic_fetch_add(ctrl, at + 1, by)
    release_fence()


@numba.njit(cache=True, nogil=True)
def _advance(ctrl: np.ndarray, at: int, by: int) -> None:
    """Publish the slots just written (after them)."""
    release_fence()
    atomic_fetch_add(ctrl, at, by)


@numba.njit(cache=True, nogil=True)
def _reserved_after_scan(ctrl: np.ndarray, at: int) -> np.int64:
    """The reservation, loaded after the window's slots were read."""
    acquire_fence()
    return atomic_load(ctrl, at + 1)


class ChangeRing:
    """``keys`` (RING_KEYS int64), its position at ``ctrl[at]`` (keys ever appended) and its reservation at
    ``ctrl[at + 1]`` (keys ever about to be appended: the position, or ahead of it during an append)."""

    def __init__(self, keys: np.ndarray, ctrl: np.ndarray, at: int) -> None:
        self.keys = keys
        self.ctrl = ctrl
        self.at = at
        self.size = keys.shape[0]
        self._append_lock = threading.Lock()  # one writer at a time (the owner's writers of several tables)

    def position(self) -> int:
        return int(_position(self.ctrl, self.at))

    def append(self, keys: np.ndarray | None) -> None:
        """Writer (after the batch reached the store): note ``keys``; None or too many: everything may be stale."""
        with self._append_lock:
            if keys is None or keys.shape[0] >= self.size:
                _reserve(self.ctrl, self.at, self.size + 1)
                _advance(self.ctrl, self.at, self.size + 1)
                return
            n = keys.shape[0]
            if n == 0:
                return
            pos = self.position() % self.size
            _reserve(self.ctrl, self.at, n)
            first = min(n, self.size - pos)
            self.keys[pos:pos + first] = keys[:first]
            if first < n:
                self.keys[: n - first] = keys[first:]
            _advance(self.ctrl, self.at, n)

    def stale(self, since: int, keys: np.ndarray) -> bool:
        """Whether any of ``keys`` may have been written after position ``since`` (True when the ring no longer
        reaches back that far, or an append overwrote part of the window while it was read)."""
        now = self.position()
        if now == since:
            return False
        if now - since > self.size:
            return True
        lo, hi = since % self.size, now % self.size
        window = self.keys[lo:hi] if lo < hi else np.concatenate([self.keys[lo:], self.keys[:hi]])
        hit = bool(np.isin(keys, window).any())
        return hit or int(_reserved_after_scan(self.ctrl, self.at)) - since > self.size
