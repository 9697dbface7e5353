"""Writing rows read from L3 into L2 (promotion, preload, outage repair) without bringing a deleted row back.

A row read before a write (put, delete, import) must not land in L2 after it: L2 may have evicted the write's row
or tombstone, and an admin delete or an import leaves none. The table's write guard tells which keys were written
since the read (see :mod:`hps_service.engine.write_guard`); those are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from hps_service.engine.table import ServedTable
from hps_service.tiers.base import Tier

log = logging.getLogger(__name__)

#: ``promote(table, keys, vectors, versions, read_at)``: how a reader has L3 hits written into L2 (the owner writes
#: its tier, see :func:`promoter`; a node's worker hands them to the owner).
Promote = Callable[[ServedTable, np.ndarray, np.ndarray, np.ndarray, int], None]


def put_read_rows(
    volatile: Tier, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, read_at: int
) -> None:
    """Write rows read from L3 into L2. Rows of keys written after ``read_at`` (the guard's generation before the
    read) are left out, or taken back out when the write ran between that check and the put (L2 then misses them;
    L3 holds the truth)."""
    keep = ~t.guard.changed_since(read_at, keys)
    if not keep.all():
        keys, vectors, versions = keys[keep], vectors[keep], versions[keep]
    if keys.shape[0] == 0:
        return
    volatile.put(t.id, keys, vectors, versions)
    overtaken = t.guard.changed_since(read_at, keys)
    if overtaken.any():
        volatile.delete(t.id, keys[overtaken])


def promote(
    volatile: Tier, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, read_at: int
) -> None:
    """Copy rows a lookup found in L3 into L2 (see :func:`put_read_rows`); a failure only costs a later L3 read."""
    try:
        put_read_rows(volatile, t, keys, vectors, versions, read_at)
    except Exception:
        log.warning("promotion of %d rows of %s into the volatile tier failed", keys.shape[0], t.id, exc_info=True)


def promoter(volatile: Tier) -> Promote:
    """The :data:`Promote` of the process that writes ``volatile``: :func:`promote` into it."""

    def into_volatile(t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray,
                      read_at: int) -> None:
        promote(volatile, t, keys, vectors, versions, read_at)

    return into_volatile


def copy_stored_rows(volatile: Tier, persistent: Tier, t: ServedTable, keys: np.ndarray) -> np.ndarray:
    """Read ``keys`` from L3 and write the rows it holds into L2 (see :func:`put_read_rows`); the found mask."""
    read_at = t.guard.generation
    got = persistent.get(t.id, keys)
    if got.found.any():
        put_read_rows(volatile, t, keys[got.found], got.vectors[got.found], got.versions[got.found], read_at)
    return got.found
