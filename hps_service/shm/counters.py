"""Counters that many processes and threads add to without locks, and one process sums; per-thread slots.

Each (process, thread) pair owns one row of a shared float64 array and is the only one to write it, so a
count is never lost to a concurrent ``+=`` and the hot path takes no lock; the owner sums the rows when it is
scraped. A row keeps counting across a worker restart (the new process adds to the old totals), so sums only
grow, as Prometheus counters must. Rows are 64-byte aligned so that two threads never write one cache line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import numba
import numpy as np

#: Thread rows per process; threads beyond them share the last row (their counts may then race).
THREAD_ROWS = 64

#: Methods whose requests are counted, and the gRPC status names (REST statuses are mapped onto these).
METHODS = ("Lookup", "StreamLookup", "RestGetEmbeddings", "RestLookupEmbeddings", "LookupBags", "StreamLookupBags",
           "RestLookupBags")
STATUSES = tuple(code.name for code in grpc.StatusCode)
#: Latency buckets (seconds): 100 us to 5 s, dense around the sub-millisecond to tens-of-milliseconds range.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.0075, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
#: Keys per request: powers of two up to the largest sensible batch.
KEYS_BUCKETS = tuple(float(2**i) for i in range(18))

_NM, _NS, _NL, _NK = len(METHODS), len(STATUSES), len(LATENCY_BUCKETS) + 1, len(KEYS_BUCKETS) + 1
#: Offsets into a request-counter row.
REQ_STATUS = 0  # [method][status] requests
REQ_LATENCY = REQ_STATUS + _NM * _NS  # [method][bucket] non-cumulative latency counts (+Inf last)
REQ_LATENCY_SUM = REQ_LATENCY + _NM * _NL  # [method]
REQ_KEYS = REQ_LATENCY_SUM + _NM  # [bucket] non-cumulative
REQ_KEYS_SUM = REQ_KEYS + _NK
REQ_IN_FLIGHT = REQ_KEYS_SUM + 1
REQ_QUEUE = REQ_IN_FLIGHT + 1  # [bucket] non-cumulative: how long calls waited for a handler thread
REQ_QUEUE_SUM = REQ_QUEUE + _NL
REQ_BAGS = REQ_QUEUE_SUM + 1  # [bucket] non-cumulative: bags per pooled request
REQ_BAGS_SUM = REQ_BAGS + _NK
REQ_FIELDS = -(-(REQ_BAGS_SUM + 1) // 8) * 8

#: Offsets into a table-counter row: hits and misses of cache, volatile, persistent, then defaults.
TABLE_HITS, TABLE_MISSES, TABLE_DEFAULTS = 0, 3, 6
TABLE_FIELDS = 8

_LATENCY = np.array(LATENCY_BUCKETS, dtype=np.float64)
_KEYS = np.array(KEYS_BUCKETS, dtype=np.float64)

STATUS_INDEX = {name: i for i, name in enumerate(STATUSES)}
METHOD_INDEX = {name: i for i, name in enumerate(METHODS)}


# The kernels below keep the GIL (no ``nogil``): each takes tens of nanoseconds, and a release would hand the GIL to a
# waiting handler thread three times a request, each time costing the releasing thread a wake-up and a wait.
@numba.njit(cache=True)
def _bucket(bounds: np.ndarray, value: float) -> int:
    for b in range(bounds.shape[0]):
        if value <= bounds[b]:
            return b
    return len(bounds)


@numba.njit(cache=True)
def _finish(row: np.ndarray, method: int, status: int, seconds: float, bounds: np.ndarray) -> None:
    row[REQ_STATUS + method * _NS + status] += 1.0
    row[REQ_LATENCY + method * _NL + _bucket(bounds, seconds)] += 1.0
    row[REQ_LATENCY_SUM + method] += seconds
    row[REQ_IN_FLIGHT] -= 1.0


@numba.njit(cache=True)
def _keys(row: np.ndarray, n: float, bounds: np.ndarray) -> None:
    row[REQ_KEYS + _bucket(bounds, n)] += 1.0
    row[REQ_KEYS_SUM] += n


@numba.njit(cache=True)
def _bags(row: np.ndarray, n: float, bounds: np.ndarray) -> None:
    row[REQ_BAGS + _bucket(bounds, n)] += 1.0
    row[REQ_BAGS_SUM] += n


@numba.njit(cache=True)
def _queued(row: np.ndarray, seconds: float, bounds: np.ndarray) -> None:
    row[REQ_QUEUE + _bucket(bounds, seconds)] += 1.0
    row[REQ_QUEUE_SUM] += seconds


class ThreadSlots:
    """Each thread's own slot of counts, made once (under ``lock``) by ``new_slot(n)``, n the number of threads
    given one before it; the thread then adds to it without a lock, and a reader sums :meth:`slots`."""

    def __init__(self, new_slot: Callable[[int], Any], lock: threading.Lock | None = None) -> None:
        self._new_slot = new_slot
        self._local = threading.local()
        self._lock = lock if lock is not None else threading.Lock()
        self._slots: list[Any] = []

    def mine(self) -> Any:
        """The calling thread's slot."""
        try:
            return self._local.slot
        except AttributeError:
            with self._lock:
                slot = self._new_slot(len(self._slots))
                self._slots.append(slot)
            self._local.slot = slot
            return slot

    def slots(self) -> list[Any]:
        """Every slot given out so far."""
        with self._lock:
            return list(self._slots)


class HitCounts(ThreadSlots):
    """Hits and misses of lookups (one process's own, exact for any number of threads)."""

    def __init__(self) -> None:
        super().__init__(lambda n: [0, 0])

    def add(self, hits: int, misses: int) -> None:
        """Count one lookup's hits and misses for the calling thread."""
        try:
            counts = self._local.slot  # mine(), without a call on the hit path
        except AttributeError:
            counts = self.mine()
        counts[0] += hits
        counts[1] += misses

    def totals(self) -> tuple[int, int]:
        """(hits, misses) summed over every thread that counted."""
        slots = self.slots()
        return sum(c[0] for c in slots), sum(c[1] for c in slots)


class ThreadRows(ThreadSlots):
    """The calling thread's row of a ``(processes, THREAD_ROWS, fields)`` counter array, for one process."""

    def __init__(self, array: np.ndarray, process: int) -> None:
        mine = array[process]
        super().__init__(lambda n: mine[min(n, THREAD_ROWS - 1)])
        self.array = array

    row = ThreadSlots.mine

    def totals(self) -> np.ndarray:
        """Every field summed over every process and thread."""
        summed: np.ndarray = self.array.sum(axis=(0, 1))
        return summed


class RequestCounters(ThreadRows):
    """Requests by method and status, latency and keys histograms, requests in flight."""

    def begin(self) -> np.ndarray:
        """A request starts on this thread; returns the row to pass to :meth:`finish`."""
        row: np.ndarray = self.row()
        row[REQ_IN_FLIGHT] += 1.0
        return row

    @staticmethod
    def finish(row: np.ndarray, method: int, status: int, seconds: float) -> None:
        """Count a finished request (``method``/``status``: indices into METHODS/STATUSES)."""
        _finish(row, method, status, seconds, _LATENCY)

    def observe_keys(self, n: int) -> None:
        _keys(self.row(), float(n), _KEYS)

    def observe_bags(self, n: int) -> None:
        _bags(self.row(), float(n), _KEYS)

    def observe_queue_wait(self, seconds: float) -> None:
        _queued(self.row(), seconds, _LATENCY)


def request_totals(totals: np.ndarray) -> dict[str, Any]:
    """The summed request fields as Prometheus-shaped data."""
    requests = totals[REQ_STATUS:REQ_LATENCY].reshape(_NM, _NS)
    latency = totals[REQ_LATENCY:REQ_LATENCY_SUM].reshape(_NM, _NL)
    return {
        "requests": {(METHODS[m], STATUSES[s]): float(requests[m, s]) for m in range(_NM) for s in range(_NS)
                     if requests[m, s]},
        "latency": {METHODS[m]: (np.cumsum(latency[m]), float(totals[REQ_LATENCY_SUM + m])) for m in range(_NM)
                    if latency[m].any()},
        "keys": (np.cumsum(totals[REQ_KEYS:REQ_KEYS_SUM]), float(totals[REQ_KEYS_SUM])),
        "in_flight": float(totals[REQ_IN_FLIGHT]),
        "queue_wait": (np.cumsum(totals[REQ_QUEUE:REQ_QUEUE_SUM]), float(totals[REQ_QUEUE_SUM])),
        "bags": (np.cumsum(totals[REQ_BAGS:REQ_BAGS_SUM]), float(totals[REQ_BAGS_SUM])),
    }


def new_counters(processes: int, fields: int) -> np.ndarray:
    """A private (one process) counter array."""
    return np.zeros((processes, THREAD_ROWS, fields), dtype=np.float64)
