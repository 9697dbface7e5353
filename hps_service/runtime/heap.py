"""Give the heap's free memory back to the operating system on a schedule.

glibc's malloc keeps freed memory in its arenas: once an array of a few hundred KiB is freed, its dynamic mmap
threshold rises and later arrays of that size (the update path's batches, the lookup path's responses) come from the
arenas, whose freed pages stay resident. Under a steady stream of updates a server's resident memory then climbs
with fragmentation while its live memory does not (measured in a soak at 10k rows/s: ``malloc_trim(0)`` released
54-58 MiB in each process of a two-worker node after five minutes). ``malloc_trim`` returns the free pages of every
arena; where it does not exist (musl, macOS) the trimmer does nothing.

RocksDB frees a memtable at once when it is flushed (the owner) or dropped at a catch-up (a worker's secondary), and
those arenas stay resident the same way until the next trim: a trimmer that watches the memtables trims as soon as
they fall, so resident memory follows them instead of lagging a trim interval behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")
#: How often a trimmer with a watched figure reads it.
WATCH_POLL_S = 1.0
#: A fall of the watched figure by this much since the last reading trims at once.
TRIM_ON_FALL_BYTES = 8 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)``, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def resident_bytes() -> int:
    """This process's resident set size in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def trim_heap() -> int:
    """Return the heap's free pages to the operating system now; the bytes of resident memory that released."""
    if _TRIM is None:
        return 0
    before = resident_bytes()
    _TRIM(0)
    return max(0, before - resident_bytes())


@dataclass
class TrimStats:
    """What the trimmer did so far in this process."""

    trims: int = 0
    released_bytes: int = 0
    seconds: float = 0.0


class HeapTrimmer:
    """A daemon thread that trims the heap every ``interval_s`` seconds (0 or no ``malloc_trim``: never), and, once
    :meth:`watch` gave it a figure of freeable memory (the memtables), as soon as that figure falls by
    :data:`TRIM_ON_FALL_BYTES`."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.stats = TrimStats()
        self._watched: Callable[[], int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def supported(self) -> bool:
        """Whether this C library can trim its heap."""
        return _TRIM is not None

    def start(self) -> None:
        """Start trimming (no-op when disabled or unsupported)."""
        if self.interval_s <= 0 or not self.supported or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="hps-heap-trim", daemon=True)
        self._thread.start()

    def watch(self, figure: Callable[[], int]) -> None:
        """Also trim whenever ``figure()`` (bytes; read every :data:`WATCH_POLL_S`) fell by
        :data:`TRIM_ON_FALL_BYTES` since its last reading. Call before :meth:`start`."""
        self._watched = figure

    def _read_watched(self) -> int | None:
        if self._watched is None:
            return None
        try:
            return self._watched()
        except Exception:  # a figure missed (a store being reopened or closed): the next reading has it
            log.debug("the trimmer's watched figure failed", exc_info=True)
            return None

    def _loop(self) -> None:
        last_trim = time.monotonic()
        seen = self._read_watched()
        poll = min(WATCH_POLL_S, self.interval_s) if self._watched is not None else self.interval_s
        while not self._stop.wait(poll):
            now = time.monotonic()
            current = self._read_watched()
            fell = seen is not None and current is not None and seen - current >= TRIM_ON_FALL_BYTES
            seen = current
            if fell or now - last_trim >= self.interval_s - 0.01:
                self.trim()
                last_trim = now

    def trim(self) -> int:
        """Trim once and count it; the bytes released."""
        start = time.perf_counter()
        released = trim_heap()
        self.stats.trims += 1
        self.stats.released_bytes += released
        self.stats.seconds += time.perf_counter() - start
        log.debug("heap trim released %.1f MiB", released / 2**20)
        return released

    def stop(self) -> None:
        """Stop the thread (it wakes at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
