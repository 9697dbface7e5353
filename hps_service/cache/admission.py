"""L1 admission by miss frequency: a key enters a full cache only after it has missed a few times lately.

Under skewed (zipf) traffic most misses of a warm cache are keys of the long tail that will not come
back before they are evicted again; admitting each one costs an insert and evicts a row that is hotter
than it. :class:`MissSketch` counts misses per key approximately (a count-min sketch of small counters
with all of a key's counters in one cache line, TinyLFU-style, all of them halved every ``window``
misses so old counts fade) and lets a key in once it has missed ``min_misses`` times. It only sees misses, so the hit path pays nothing for it; hot keys new
to the cache still get in after a miss or two.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from hps_service.errors import InvalidArgumentError
from hps_service.jit.hashing import mix64
from hps_service.jit.prefetch import prefetch

_S32 = np.uint64(32)
#: Counters per key, all in one 64-byte block of the sketch so that counting a miss costs one cache line.
DEPTH = 4
BLOCK = 64
#: Counters stop here: enough to tell "missed a few times" apart, and halving keeps them small anyway.
COUNTER_MAX = 15
#: Misses counted between two halvings, per row of cache capacity. Measured on zipf(1.05) over a table 5x the
#: cache: a window of 1x keeps the hit rate at 0.89-0.90 with 8-30x fewer inserts than admitting every miss
#: (0.866); 3x and 10x windows let most of the tail through again (TinyLFU's 10x counts every access, not misses).
WINDOW_PER_ROW = 1
#: The window is at least this many of the largest batches of misses seen (so a key missed in two batches in
#: a row counts twice however big the batches are).
BATCHES_PER_WINDOW = 2
#: Keys ahead whose sketch block is prefetched while the current key is counted.
PREFETCH_AHEAD = 8


@numba.njit(cache=True, nogil=True)
def _count_misses(table: np.ndarray, keys: np.ndarray, min_misses: int, admit: np.ndarray) -> None:
    # A key's DEPTH counters sit in block mix(key) % blocks, at offsets taken from the hash's high bits.
    # Conservative update: only the counters at the key's current minimum go up, which keeps the
    # over-count from colliding keys low. A key is admitted when its estimate reaches min_misses.
    n = keys.shape[0]
    blocks = np.uint64(table.shape[0])
    block_of = np.empty(n, np.int64)
    offsets = np.empty(n, np.uint64)
    for i in range(n):
        x = mix64(keys[i])
        block_of[i] = np.int64((x & np.uint64(0xFFFFFFFF)) % blocks)
        offsets[i] = x >> _S32
    for j in range(n + PREFETCH_AHEAD):
        if j < n:
            prefetch(table, block_of[j], 0)
        i = j - PREFETCH_AHEAD
        if i < 0:
            continue
        b = block_of[i]
        bits = offsets[i]
        low = np.uint8(255)
        for d in range(DEPTH):
            c = table[b, np.int64((bits >> np.uint64(6 * d)) & np.uint64(BLOCK - 1))]
            if c < low:
                low = c
        if low < COUNTER_MAX:
            for d in range(DEPTH):
                p = np.int64((bits >> np.uint64(6 * d)) & np.uint64(BLOCK - 1))
                if table[b, p] == low:
                    table[b, p] = low + 1
            low += 1
        admit[i] = low >= min_misses


class MissSketch:
    """Approximate per-key miss counts of one table's L1; decides which missed keys are admitted."""

    def __init__(self, capacity_rows: int, min_misses: int) -> None:
        if capacity_rows < 1:
            raise InvalidArgumentError(f"capacity_rows must be >= 1, got {capacity_rows}")
        if not 1 <= min_misses <= COUNTER_MAX:
            raise InvalidArgumentError(f"admit_after_misses must be in [1, {COUNTER_MAX}], got {min_misses}")
        self.min_misses = min_misses
        self.window = WINDOW_PER_ROW * capacity_rows
        # About one counter per cached row per depth (4 bytes a row), at least 16 blocks.
        self._table = np.zeros((max(16, -(-DEPTH * capacity_rows // BLOCK)), BLOCK), dtype=np.uint8)
        self._counted = 0
        self._lock = threading.Lock()

    def admit(self, keys: np.ndarray) -> np.ndarray:
        """Count one miss for each of ``keys`` (int64, unique) and return which of them may enter the cache."""
        admit = np.empty(keys.shape[0], dtype=np.bool_)
        if keys.shape[0] == 0:
            return admit
        with self._lock:
            # A window spans at least a few batches, or a batch bigger than it would fade its own counts.
            self.window = max(self.window, BATCHES_PER_WINDOW * keys.shape[0])
            if self._counted >= self.window:
                np.right_shift(self._table, 1, out=self._table)
                self._counted = 0
            _count_misses(self._table, keys.view(np.uint64), self.min_misses, admit)
            self._counted += keys.shape[0]
        return admit

    def reset(self) -> None:
        """Forget every count (after the cache is cleared)."""
        with self._lock:
            self._table.fill(0)
            self._counted = 0
