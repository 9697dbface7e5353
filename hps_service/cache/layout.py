"""The arrays that are the L1 cache: every piece of its state, allocatable by the caller.

A cache is nothing but these arrays (no process-local state is needed to read it correctly), so a store can
place them in memory shared by several processes and every process reads the same cache:

* ``tags`` ``(sets, ways)`` uint8: the slot's state. 0 is a free slot; an occupied slot holds
  ``0x80 | (mix64(key) & 0x7F)``, seven hash bits the set index does not use. The state is never a key
  value, so every int64 is a valid key, and a probe scans 32 one-byte tags and compares a key only where
  the tag matches (a miss compares about ways/128 keys).
* ``keys`` ``(sets, ways)`` int64 and ``versions`` ``(sets, ways)`` int64: meaningful where the tag is not 0.
* ``clock`` ``(sets, ways)`` int32: LRU, the low 31 bits of the tick of the last access (read back against the
  current tick by :func:`scores`, see :mod:`hps_service.jit.ticks`); LFU, the
  access count, which stops at ``LFU_CAP``.
* ``values`` ``(sets * ways, dim)`` float32: the rows.
* ``meta`` ``(META_LEN,)`` int64: the sequence-lock counter, the tick, and the writers' counters (rows,
  evictions), each on its own 64-byte line so readers drawing ticks do not bounce the sequence's line.

All-zero memory is an empty cache, so freshly mapped shared memory needs no initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps_service.jit import ticks

#: Indices into ``meta``: one int64 per 64-byte line.
META_SEQ, META_TICK, META_ROWS, META_EVICTIONS = 0, 8, 16, 24
META_LEN = 32
#: The tick bits an LRU clock keeps (read back as an age by :mod:`hps_service.jit.ticks`).
CLOCK_MASK = ticks.MASK
#: LFU counts stop here, far enough below 2**31 that concurrent adds past the check never overflow.
LFU_CAP = 1 << 30
#: The score of a free slot: below every occupied slot's (see :func:`scores`).
FREE_SCORE = -(1 << 32)
#: A free slot's tag is 0; occupied slots have the high bit set.
TAG_BIT = 0x80
TAG_HASH_MASK = 0x7F

#: ``alloc(shape, dtype) -> zeroed array`` (NumPy, CuPy, or a view of shared memory).
Allocator = Callable[[tuple[int, ...], np.dtype], Any]


def numpy_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The default host allocator."""
    return np.zeros(shape, dtype=dtype)


def scores(clock: Any, tick: int, lfu: bool) -> Any:
    """How hot slots are (int64, higher is hotter) from their clocks at ``tick``: LFU, the count; LRU, minus the
    ticks since the last access. Works on NumPy and CuPy arrays alike."""
    c = clock.astype(np.int64)
    return c if lfu else -ticks.signed_age(tick, c)


@dataclass(frozen=True, slots=True)
class CacheArrays:
    """One cache's arrays (see the module docstring); shapes define sets, ways and dim."""

    tags: Any
    keys: Any
    versions: Any
    clock: Any
    values: Any
    meta: Any

    @classmethod
    def allocate(cls, sets: int, ways: int, dim: int, alloc: Allocator = numpy_zeros) -> CacheArrays:
        """Zeroed arrays for ``sets`` x ``ways`` slots of ``dim`` float32 each, from ``alloc``."""
        arrays = cls(
            tags=alloc((sets, ways), np.dtype(np.uint8)),
            keys=alloc((sets, ways), np.dtype(np.int64)),
            versions=alloc((sets, ways), np.dtype(np.int64)),
            clock=alloc((sets, ways), np.dtype(np.int32)),
            values=alloc((sets * ways, dim), np.dtype(np.float32)),
            meta=alloc((META_LEN,), np.dtype(np.int64)),
        )
        arrays.check()
        return arrays

    def check(self) -> None:
        """Raise ValueError unless shapes and dtypes fit together (arrays a caller allocated)."""
        sets, ways = self.tags.shape
        want = {
            "tags": ((sets, ways), np.uint8), "keys": ((sets, ways), np.int64),
            "versions": ((sets, ways), np.int64), "clock": ((sets, ways), np.int32),
            "values": ((sets * ways, self.values.shape[1]), np.float32), "meta": ((META_LEN,), np.int64),
        }
        for name, (shape, dtype) in want.items():
            arr = getattr(self, name)
            if tuple(arr.shape) != shape or np.dtype(arr.dtype) != np.dtype(dtype):
                raise ValueError(f"cache array {name} must be {np.dtype(dtype)} {shape}, got {arr.dtype} {arr.shape}")

    @property
    def sets(self) -> int:
        return int(self.tags.shape[0])

    @property
    def ways(self) -> int:
        return int(self.tags.shape[1])

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    @property
    def capacity(self) -> int:
        return self.sets * self.ways

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(self, n).nbytes for n in ("tags", "keys", "versions", "clock", "values", "meta")))
