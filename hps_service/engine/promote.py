"""Writing rows read from L3 into L2 (promotion, preload, outage repair) without bringing a deleted row back.

Versioned puts keep a row written meanwhile that is newer and tombstones refuse older rows; an admin delete
leaves no tombstone, so the table's log of admin deletes keeps rows read before one out of L2.
"""

from __future__ import annotations

import logging

import numpy as np

from hps_service.engine.table import ServedTable
from hps_service.tiers.base import Tier

log = logging.getLogger(__name__)


def put_read_rows(
    volatile: Tier, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, read_at: int
) -> None:
    """Write rows read from L3 into L2. Rows an admin delete removed after ``read_at`` (the delete generation before
    the read) are left out, or taken back out when the delete ran between that check and the put."""
    keep = ~t.deleted_since(read_at, keys)
    if not keep.all():
        keys, vectors, versions = keys[keep], vectors[keep], versions[keep]
    volatile.put(t.id, keys, vectors, versions)
    resurrected = t.deleted_since(read_at, keys)
    if resurrected.any():
        volatile.delete(t.id, keys[resurrected])


def promote(
    volatile: Tier, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, read_at: int
) -> None:
    """Copy rows a lookup found in L3 into L2 (see :func:`put_read_rows`); a failure only costs a later L3 read."""
    try:
        put_read_rows(volatile, t, keys, vectors, versions, read_at)
    except Exception:
        log.warning("promotion of %d rows of %s into the volatile tier failed", keys.shape[0], t.id, exc_info=True)


def copy_stored_rows(volatile: Tier, persistent: Tier, t: ServedTable, keys: np.ndarray) -> np.ndarray:
    """Read ``keys`` from L3 and write the rows it holds into L2 (see :func:`put_read_rows`); the found mask."""
    read_at = t.unversioned_deletes.generation
    got = persistent.get(t.id, keys)
    if got.found.any():
        put_read_rows(volatile, t, keys[got.found], got.vectors[got.found], got.versions[got.found], read_at)
    return got.found
