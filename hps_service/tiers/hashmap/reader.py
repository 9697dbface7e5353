"""Lock-free reads of a hash-map table from another process (the node's workers and colocated clients), over the
arrays the writing process shares (see ``seqlock``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hps_service.jit.views import read_only_view
from hps_service.tiers.base import LaneRead, Rows, check_positions
from hps_service.tiers.hashmap import seqlock
from hps_service.tiers.hashmap.lane import Lane
from hps_service.tiers.hashmap.stamps import stamp_halves


@dataclass
class TableArrays:
    """The arrays of one table as another process maps them (the index is replaced as it grows)."""

    ctrl: np.ndarray
    meta: np.ndarray
    rows: np.ndarray
    reader_stamps: np.ndarray | None  # None: a read-only reader, whose reads are not recorded for eviction
    index: np.ndarray
    index_gen: int


#: ``open_index(generation) -> index``: map an index generation a reader has not seen yet (its whole file).
OpenIndex = Callable[[int], np.ndarray]
#: Back-off of a reader that keeps overlapping writes: it sleeps this long (then twice as long, up to the cap)
#: instead of spinning, so a long write (an index rebuild, an eviction) does not burn its CPU.
_READ_SPINS = 8
_READ_SLEEP_S, _READ_SLEEP_CAP_S = 20e-6, 2e-3


class TableReader:
    """Lock-free reads of one hash-map table that another process writes (the node's workers and colocated
    clients); never blocks the writer and never returns a row that a write was changing."""

    def __init__(self, arrays: TableArrays, open_index: OpenIndex, lfu: bool) -> None:
        self.arrays = arrays
        self.dim = arrays.rows.shape[1]
        self._open_index = open_index
        self._lfu = lfu
        # read-only views whether this process maps the table writable (a worker) or not (a LocalClient), as the
        # request's keys are in fill: the read kernel has one specialisation to compile (see jit/views.py)
        self._keys = read_only_view(arrays.meta[:, 0])
        self._versions = read_only_view(arrays.meta[:, 1])
        self._stamps = read_only_view(stamp_halves(arrays.meta)[0])
        self.retries = 0
        self._lane: Lane | None = None

    def lane(self) -> LaneRead:
        """The compiled pass over the table (:mod:`.lane`): lock-free, hits stamped unless this reader is
        read-only."""
        if self._lane is None:
            a = self.arrays
            self._lane = Lane(a.ctrl, a.meta, a.rows, a.reader_stamps, stamp_halves(a.meta)[0], self._lfu,
                              self._mapped_index, self._remap)
        return self._lane.read

    @property
    def lane_retries(self) -> int:
        """Compiled passes run again because a write overlapped them."""
        return self._lane.retries if self._lane is not None else 0

    def _mapped_index(self) -> tuple[np.ndarray, int]:
        return self.arrays.index, self.arrays.index_gen

    def get(self, keys: np.ndarray) -> Rows:
        """Rows of ``keys`` as of one state of the table (see ``seqlock.read_rows_at``)."""
        n = keys.shape[0]
        out = Rows(vectors=np.empty((n, self.dim), dtype=np.float32), versions=np.empty(n, dtype=np.int64),
                   found=np.empty(n, dtype=bool))
        self.fill(keys, np.arange(n), out.vectors, out.versions, out.found)
        return out

    def fill(self, keys: np.ndarray, positions: np.ndarray, out: np.ndarray, versions: np.ndarray,
             found: np.ndarray) -> int:
        """The rows of ``keys[positions]`` into ``out[positions]``, as of one state of the table (see
        :meth:`hps_service.tiers.base.Tier.fill`); returns how many the table holds."""
        check_positions(keys, positions, out, self.dim)
        a = self.arrays
        row_ids = np.empty(positions.shape[0], dtype=np.int64)
        attempt = 0
        sleep = _READ_SLEEP_S
        while True:
            index = a.index
            got = seqlock.read_rows_at(a.ctrl, index, np.int64(a.index_gen), self._keys, a.rows, self._versions,
                                       self._stamps, read_only_view(keys), positions, out, versions, found, row_ids)
            if got >= 0:
                break
            if got == seqlock.READ_REMAP:
                self._remap()
                continue
            self.retries += 1
            attempt += 1
            if attempt > _READ_SPINS:
                time.sleep(sleep)
                sleep = min(2 * sleep, _READ_SLEEP_CAP_S)
        if a.reader_stamps is not None and got:
            seqlock.stamp_reads(a.reader_stamps, row_ids, seqlock.tick(a.ctrl) if not self._lfu else np.int64(0),
                                self._lfu)
        return int(got)

    def _remap(self) -> None:
        """Map the index generation the writer published (its length is its file's)."""
        a = self.arrays
        gen = int(a.ctrl[seqlock.CTRL_INDEX_GEN])
        try:
            index = self._open_index(gen)
        except Exception:  # noqa: BLE001 - replaced again meanwhile (the file is gone): read the newer one
            time.sleep(_READ_SLEEP_S)
            return
        a.index, a.index_gen = index, gen
