"""Writing rows read from L3 into L2 (promotion, preload, outage repair) without bringing a deleted row back.

A row read before a write (put, delete, import) must not land in L2 after it: L2 may have evicted the write's row
or tombstone, and an admin delete or an import leaves none. The table's write guard tells which keys were written
since the read (see :mod:`hps_service.engine.write_guard`); those are left out, and the put is made under the
table's write lock, so no write lands between that check and the put: nothing is ever put that must be taken back
out, and a table that holds every stored row (:mod:`hps_service.tiers.hashmap.complete`) keeps holding them.
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
    volatile: Tier, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, read_at: int,
    wait: bool = False,
) -> bool:
    """Write rows read from L3 into L2, under the table's write lock: rows of keys written after ``read_at`` (the
    guard's generation before the read) are left out (L2 then misses them; L3 holds the truth). ``wait``: for a
    write that holds the lock now; else the rows are not written (a later read promotes them). Whether it ran."""
    if not t.guard.lock.acquire(blocking=wait):
        return False
    try:
        keep = ~t.guard.changed_since(read_at, keys)
        if not keep.all():
            keys, vectors, versions = keys[keep], vectors[keep], versions[keep]
        if keys.shape[0]:
            volatile.put(t.id, keys, vectors, versions)
        return True
    finally:
        t.guard.lock.release()


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
    """Read ``keys`` from L3 and write the rows it holds into L2 (see :func:`put_read_rows`, waiting for the write
    lock); the found mask."""
    read_at = t.guard.generation
    got = persistent.get(t.id, keys)
    if got.found.any():
        put_read_rows(volatile, t, keys[got.found], got.vectors[got.found], got.versions[got.found], read_at, True)
    return got.found
