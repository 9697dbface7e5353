"""A count-min sketch of how often each id was seen, so a table admits an id only once it has earned a row.

``depth`` rows of ``width`` saturating uint16 counters, one splitmix64 hash per row; a batch of distinct keys with
their occurrence counts is added in one compiled pass with the conservative update (only the smallest counters
grow), which keeps the estimate an upper bound of the true count that collisions inflate as little as possible.
With ``w`` counters a row an estimate exceeds the true count by more than ``e / w`` of all ids counted with
probability at most ``exp(-depth)``. Sketches of disjoint key sets (one per data-parallel rank) add up.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hps_service.errors import InvalidArgumentError
from hps_service.jit.hashing import mix64

_SEEDS = np.array([0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89,
                   0x452821E638D01377, 0xBE5466CF34E90C6C, 0xC0AC29B7C97C50DD, 0x3F84D5B5B5470917],
                  dtype=np.uint64)
_MAX = np.uint32(np.iinfo(np.uint16).max)


@njit(cache=True, nogil=True)
def _add(table: np.ndarray, seeds: np.ndarray, keys: np.ndarray, counts: np.ndarray, out: np.ndarray) -> None:
    depth, width = table.shape
    mask = np.uint64(width - 1)
    for i in range(keys.shape[0]):
        key = np.uint64(keys[i])
        low = _MAX
        for d in range(depth):
            c = np.uint32(table[d, np.int64(mix64(key ^ seeds[d]) & mask)])
            if c < low:
                low = c
        new = min(low + np.uint32(counts[i]), _MAX)
        for d in range(depth):
            j = np.int64(mix64(key ^ seeds[d]) & mask)
            if table[d, j] < new:
                table[d, j] = new
        out[i] = new


class CountMinSketch:
    """Approximate occurrence counts of int64 keys (never below the true count, saturating at 65535)."""

    def __init__(self, width: int = 1 << 20, depth: int = 4) -> None:
        if width < 16 or width & (width - 1):
            raise InvalidArgumentError(f"sketch width must be a power of two >= 16, got {width}")
        if not 1 <= depth <= _SEEDS.size:
            raise InvalidArgumentError(f"sketch depth must be in [1, {_SEEDS.size}], got {depth}")
        self.counters = np.zeros((depth, width), dtype=np.uint16)

    def add(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Count ``counts[i]`` more sightings of distinct ``keys[i]``; returns every key's estimate after it."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        out = np.empty(keys.shape[0], dtype=np.uint32)
        _add(self.counters, _SEEDS[: self.counters.shape[0]], keys,
             np.ascontiguousarray(np.minimum(counts, int(_MAX)), dtype=np.uint32), out)
        return out

    def merge(self, counters: np.ndarray) -> None:
        """Add another sketch's counters of the same shape (of a disjoint key set), saturating."""
        if counters.shape != self.counters.shape:
            raise InvalidArgumentError(f"sketch of shape {counters.shape} cannot merge into {self.counters.shape}")
        total = self.counters.astype(np.uint32) + counters.astype(np.uint32)
        self.counters = np.minimum(total, int(_MAX)).astype(np.uint16)
