"""The owner's announcements to its workers' RocksDB secondary instances (issue 27, defect 1), in the store's header.

``H_L3_FILES`` is odd while the owner's store changes files in a way a secondary's catch-up cannot follow (a flush
whose marker is not written yet, the deletion of flushed logs, an ingest, a reopen: see
:mod:`hps_service.tiers.rocksdb.flush`); a worker trusts a catch-up only when it was even and unchanged from before
the catch-up to after it, and catches up again otherwise. ``H_L3_OPENS`` counts the primary's reopens: a worker opens
its secondary afresh when it changed. Written with sequentially consistent adds, read with acquire loads.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from hps_service.jit.atomic import atomic_fetch_add, atomic_load
from hps_service.node.store.layout import H_L3_FILES, H_L3_OPENS


@numba.njit(cache=True, nogil=True)
def _add(header: np.ndarray, at: int, by: int) -> None:
    atomic_fetch_add(header, at, by)


@numba.njit(cache=True, nogil=True)
def _load(header: np.ndarray, at: int) -> np.int64:
    return atomic_load(header, at)


class L3Announcer:
    """The owner's side (a ``tiers.rocksdb_flush.FileEvents``): announcements of its threads may overlap, and the
    header stays odd from the first begin to the last end."""

    def __init__(self, header: np.ndarray) -> None:
        self._header = header
        self._lock = threading.Lock()
        self._open = 0

    def begin(self) -> None:
        with self._lock:
            self._open += 1
            if self._open == 1:
                _add(self._header, H_L3_FILES, 1)

    def end(self, reopened: bool) -> None:
        with self._lock:
            if reopened:
                _add(self._header, H_L3_OPENS, 1)
            self._open -= 1
            if self._open == 0:
                _add(self._header, H_L3_FILES, 1)


def l3_events(header: np.ndarray) -> tuple[int, int]:
    """A worker's side: (files counter, opens counter) as the owner last published them."""
    return int(_load(header, H_L3_FILES)), int(_load(header, H_L3_OPENS))
