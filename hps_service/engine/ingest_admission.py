"""Admission at ingest (``tables[].admit_after_writes: N``): a frequency filter that keeps one-off ids out of every
tier. Not to be confused with the L1 cache's admission (:mod:`hps_service.cache.admission`), which decides what L1
holds of rows already stored.

Rules, for a table with ``N > 1`` (``N == 1``, the default, builds no filter and costs nothing):

- every put of the update log (``LookupEngine.apply_changes`` through ``PreparedChange.write``) and of ``Writer.apply_updates``
  counts one write of its key in a count-min sketch of the table; duplicates of a key in one batch count as as many
  writes, in batch order;
- a key already stored in the table is always admitted: one the persistent tier holds a live row of, or, without a
  persistent tier, the volatile one (one batch ``get`` of the keys not yet counted to N). An update of an imported
  or already admitted row is never dropped; a deleted key (a tombstone) or one evicted from a volatile-only store
  is not stored, so its count alone decides;
- a new key is admitted by the write that brings its count to ``N`` or more (that write's row is stored, and every
  later one); the writes before are dropped, counted in the table's stats (``admission.dropped``), and not stored;
- deletes and imports (``import_rows``) are never filtered.

The sketch is :data:`DEPTH` rows of ``2**width_bits`` saturating uint16 counters (default 4 x 2**20: 8 MiB per
filtered table), updated conservatively (only the counters at the key's minimum grow), so a count is never below the
true number of writes and collisions can only admit a key early. It lives in the owner's memory (the single writer;
node workers never write): counts survive a model reload or a conversion in this process (see :func:`keep_counts`),
not a restart, after which a new key needs N more writes. Every call is made with the table's write lock held, and
counts before the tiers are written: a write that then fails has still been counted (a count may only run ahead).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numba
import numpy as np

from hps_service.jit.hashing import mix64
from hps_service.jit.views import read_only_view
from hps_service.keys import unique_with_inverse
from hps_service.tiers.base import Tier

#: Rows of the sketch (independent hashes per key).
DEPTH = 4
#: Counters per row of the sketch: 2**20, so 8 MiB of uint16 per filtered table at DEPTH 4.
WIDTH_BITS = 20
#: Where a counter stops: ``admit_after_writes`` is at most this, so a saturated counter always admits.
MAX_COUNT = int(np.iinfo(np.uint16).max)
#: One seed per sketch row, xor-ed into the key before the splitmix64 finalizer (a bijection, so rows differ).
_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                  dtype=np.uint64)


@numba.njit(cache=True, nogil=True)
def _count_writes(counters: np.ndarray, seeds: np.ndarray, mask: np.uint64, keys: np.ndarray,
                  out: np.ndarray) -> None:
    # Per key in batch order: find its DEPTH counters, raise those at the minimum by one (saturating), and write
    # the key's count after this write to ``out``.
    depth = counters.shape[0]
    slots = np.empty(depth, dtype=np.int64)
    for i in range(keys.shape[0]):
        low = np.int64(MAX_COUNT)
        for r in range(depth):
            s = np.int64(mix64(np.uint64(keys[i]) ^ seeds[r]) & mask)
            slots[r] = s
            low = min(low, np.int64(counters[r, s]))
        if low < MAX_COUNT:
            for r in range(depth):
                if np.int64(counters[r, slots[r]]) == low:
                    counters[r, slots[r]] = low + 1
            low += 1
        out[i] = low


@numba.njit(cache=True, nogil=True)
def _estimate(counters: np.ndarray, seeds: np.ndarray, mask: np.uint64, keys: np.ndarray, out: np.ndarray) -> None:
    for i in range(keys.shape[0]):
        low = np.int64(MAX_COUNT)
        for r in range(counters.shape[0]):
            low = min(low, np.int64(counters[r, np.int64(mix64(np.uint64(keys[i]) ^ seeds[r]) & mask)]))
        out[i] = low


class WriteSketch:
    """A count-min sketch of writes per int64 key: ``DEPTH x 2**width_bits`` saturating uint16 counters."""

    def __init__(self, width_bits: int = WIDTH_BITS) -> None:
        self.counters = np.zeros((DEPTH, 1 << width_bits), dtype=np.uint16)
        self._mask = np.uint64((1 << width_bits) - 1)

    @property
    def nbytes(self) -> int:
        return int(self.counters.nbytes)

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Count one write per entry of ``keys`` (in order); returns each entry's count after its write (uint16)."""
        keys = read_only_view(np.ascontiguousarray(keys, dtype=np.int64))  # one specialisation (jit/views.py)
        out = np.empty(keys.shape[0], dtype=np.uint16)
        _count_writes(self.counters, _SEEDS, self._mask, keys, out)
        return out

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """The counts of ``keys`` (never below their true write counts; saturated at :data:`MAX_COUNT`)."""
        keys = read_only_view(np.ascontiguousarray(keys, dtype=np.int64))
        out = np.empty(keys.shape[0], dtype=np.uint16)
        _estimate(self.counters, _SEEDS, self._mask, keys, out)
        return out


class IngestFilter:
    """The admission of one table's puts: its sketch, its threshold and how many writes it dropped."""

    def __init__(self, after_writes: int, width_bits: int = WIDTH_BITS) -> None:
        if not 1 <= after_writes <= MAX_COUNT:
            raise ValueError(f"admit_after_writes must be in [1, {MAX_COUNT}], got {after_writes}")
        self.after_writes = after_writes
        self.sketch = WriteSketch(width_bits)
        self.dropped = 0

    def admit(self, keys: np.ndarray, stored_in: Tier | None, table: str) -> np.ndarray:
        """Count the puts of ``keys`` (int64, duplicates included) and return the mask of those admitted: counted to
        ``after_writes``, or of a key ``stored_in`` holds a live row of in ``table``."""
        keep = self.sketch.add(keys) >= self.after_writes
        rest = np.flatnonzero(~keep)
        if rest.size and stored_in is not None:
            uniq, inverse = unique_with_inverse(keys[rest])
            keep[rest] = stored_in.get(table, uniq).found[inverse]
        self.dropped += int(keep.shape[0] - np.count_nonzero(keep))
        return keep

    def stats(self) -> dict[str, int]:
        """``{"after_writes": N, "dropped": writes dropped so far}``."""
        return {"after_writes": self.after_writes, "dropped": self.dropped}


def ingest_filter(after_writes: int) -> IngestFilter | None:
    """The filter of a table configured with ``admit_after_writes`` (None at 1: every write is admitted)."""
    return IngestFilter(after_writes) if after_writes > 1 else None


class Filtered(Protocol):
    """What carries an ingest filter (a served table)."""

    ingest: IngestFilter | None


def keep_counts(old: Mapping[str, Filtered], new: Mapping[str, Filtered]) -> None:
    """Carry the counts and drops of the tables ``old`` (a model being replaced) into the same-named ``new`` tables
    that filter too (whatever their threshold), so a reload or a conversion does not start the counts again."""
    for name, t in new.items():
        before = old.get(name)
        if t.ingest is not None and before is not None and before.ingest is not None:
            t.ingest.sketch = before.ingest.sketch
            t.ingest.dropped = before.ingest.dropped


def warm_up_kernels() -> None:
    """Compile (or load) the sketch's kernels (their wrappers pass every key array read-only: one specialisation)."""
    sketch = WriteSketch(width_bits=4)
    keys = np.array([3, 1, 3], dtype=np.int64)
    sketch.add(keys)
    sketch.estimate(keys)
