"""When a writable RocksDB store flushes its memtables, so that a secondary instance never answers from before a flush.

RocksDB 10.4 (rocksdict 0.3.29, the newest; the fix, upstream PR 15066, is in no release yet) has a secondary
instance keep the memtable it replayed from a write-ahead log once the primary flushed that log, and serve its older
rows over the flushed newer ones (upstream issues 14444 and 15051), until it replays a batch of that column family
from the log the flush started; and a catch-up that overlaps the deletion of a flushed log can miss that log's tail.
So this module decides every flush instead of RocksDB (whose own memtable and log limits are set out of reach):

* a column family is switched to a new memtable (``flush(wait=False)``) when its memtable reaches
  ``write_buffer_mb``, or every one of them when the logs written since the last reclaim reach ``max_total_wal_mb``,
  always under the tier's write lock, and right after the switch a *marker* (a delete of the empty key, which no
  read sees) is written to it: the first batch in the new log, which makes a secondary drop the replayed memtable;
* every write batch carries a marker in the otherwise unused ``default`` column family (the *pin*), so that no log
  becomes obsolete, and none is deleted, before the pin itself is flushed (the log bound matters: the positions are
  written with every batch and never fill a memtable, and a soak at 10k rows/s kept 2.3 GB of logs for 3 MB of rows
  before there was one: a restart replays them all, and each worker's secondary holds them as memtables);
* the pin is flushed (and the old logs deleted) only inside an announced window (``FileEvents``), as are RocksDB's own
  flushes of a checkpoint or an ingest and a reopen after a write error: a secondary does not trust a catch-up that
  overlapped one (``hps_service.node.reader_tiers``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rocksdict import WriteBatch

if TYPE_CHECKING:
    from rocksdict import Rdict, WriteOptions

log = logging.getLogger(__name__)

#: RocksDB's own memtable size and log bound, out of reach (its memtable size is clipped to 64 GiB).
NEVER_BYTES = 1 << 36
#: The marker key: RocksDB keys of rows are 8 bytes, so no row has it; a delete of it is invisible to every read.
MARKER = b""
#: How long a flush, or the deletion of the logs it made obsolete, is waited for (then logged and left).
FLUSH_WAIT_S = 30.0
_POLL_S = 0.002


class FileEvents(Protocol):
    """Told before and after the store's files change in a way a secondary's catch-up cannot follow."""

    def begin(self) -> None:
        """A flush that deletes write-ahead logs, an ingest, or a reopen starts."""

    def end(self, reopened: bool) -> None:
        """It is done (``reopened``: the primary was reopened, secondaries must open afresh)."""


class _Silent:
    def begin(self) -> None:
        return None

    def end(self, reopened: bool) -> None:
        return None


def wal_numbers(path: Path) -> list[int]:
    """Numbers of the write-ahead logs in a store's directory, oldest first."""
    return sorted(int(p.stem) for p in Path(path).glob("*.log") if p.stem.isdigit())


def wal_bytes(path: Path) -> int:
    """Bytes of the write-ahead logs in a store's directory (those RocksDB deletes meanwhile left out)."""
    total = 0
    for p in Path(path).glob("*.log"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            continue
    return total


class Flusher:
    """The flush policy of one writable store (see the module docstring); the tier calls it under its write lock."""

    def __init__(self, path: Path, write_buffer_bytes: int, max_total_wal_bytes: int,
                 events: FileEvents | None = None) -> None:
        self.path = Path(path)
        self.write_buffer_bytes = write_buffer_bytes
        self.max_total_wal_bytes = max_total_wal_bytes
        self.events: FileEvents = events or _Silent()
        self._db: Rdict | None = None
        self._write_opts: WriteOptions | None = None
        self._sync = True
        self._families: dict[str, Rdict] = {}  # name -> column family, the pin ("default") excluded
        self._wal_bytes = 0
        self._reclaim_below: int | None = None  # a requested reclaim makes the logs below this one obsolete
        self._wake = threading.Condition()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.flushes = 0  # switches made (each flushes one memtable), for stats and tests

    def attach(self, db: Rdict, write_opts: WriteOptions, sync: bool, families: dict[str, Rdict]) -> None:
        """The open primary and its column families (again after a reopen)."""
        self._db, self._write_opts, self._sync, self._families = db, write_opts, sync, dict(families)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hps-rocksdb-flush", daemon=True)
            self._thread.start()

    def add_family(self, name: str, cf: Rdict) -> None:
        self._families[name] = cf

    def drop_family(self, name: str) -> None:
        self._families.pop(name, None)

    def families(self) -> list[str]:
        """Every column family this policy flushes (the pin's aside)."""
        return list(self._families)

    # ---- the write path (tier lock held) --------------------------------------------------------
    def pin(self, batch: WriteBatch) -> None:
        """Keep the log this batch lands in alive until the pin is flushed."""
        assert self._db is not None
        batch.delete(MARKER, self._db.get_column_family_handle("default"))

    def written(self, batch_bytes: int, families: Sequence[str]) -> None:
        """A batch of ``batch_bytes`` reached the store, writing to ``families``: switch what is full."""
        self._wal_bytes += batch_bytes
        if self._wal_bytes >= self.max_total_wal_bytes:
            self._switch_all_and_reclaim()
            return
        full = [name for name in dict.fromkeys(families) if name in self._families
                and (self._families[name].property_int_value("rocksdb.cur-size-active-mem-table") or 0)
                >= self.write_buffer_bytes]
        if full:
            self.switch(full)

    def switch(self, names: list[str]) -> None:
        """Start a flush of each column family of ``names`` (nothing is written in between) and write their markers:
        the first batch of the log the switch started. Caller holds the tier lock."""
        assert self._db is not None
        with self._announced_if_logs_may_go():
            for name in names:
                self._families[name].flush(False)
            self.mark(names)
        self.flushes += len(names)

    def filled(self) -> list[str]:
        """The column families whose memtable holds anything."""
        return [name for name, cf in self._families.items()
                if cf.property_int_value("rocksdb.num-entries-active-mem-table")]

    def mark(self, names: list[str]) -> None:
        """Write a marker to each of ``names`` (after a switch RocksDB made itself: a checkpoint's, an ingest's)."""
        assert self._db is not None and self._write_opts is not None
        batch = WriteBatch(raw_mode=True)
        for name in names:
            batch.delete(MARKER, self._db.get_column_family_handle(name))
        self.pin(batch)
        self._db.write(batch, self._write_opts)
        if self._sync:
            self._db.flush_wal(True)

    @contextmanager
    def _announced_if_logs_may_go(self) -> Iterator[None]:
        """A switch deletes no log (the pin keeps them) but its flush may finish before the marker is written: the
        window between is announced so that a secondary catching up in it tries again."""
        self.events.begin()
        try:
            yield
        finally:
            self.events.end(False)

    def _switch_all_and_reclaim(self) -> None:
        """The logs reached their bound: switch every column family now, delete the old logs in the background."""
        if not self._idle.is_set() and self._wal_bytes >= 2 * self.max_total_wal_bytes:
            self._idle.wait(FLUSH_WAIT_S)  # the last reclaim is still running and the logs keep growing: wait
        if not self._idle.is_set():
            return
        self.switch(self.filled())
        self._wal_bytes = 0
        logs = wal_numbers(self.path)
        with self._wake:
            self._reclaim_below = logs[-1] if logs else None
            self._idle.clear()
            self._wake.notify()

    # ---- announced operations -------------------------------------------------------------------
    @contextmanager
    def announced(self, reopened: bool = False, drops_logs: bool = True) -> Iterator[None]:
        """Around a flush RocksDB starts itself (checkpoint, ingest), the pin's, or a reopen: announced, and with
        ``drops_logs`` the logs older than the newest are waited for on the way out (every column family flushed:
        they are obsolete), so that no secondary catches up across their deletion unannounced."""
        self.events.begin()
        try:
            yield
            if drops_logs:
                logs = wal_numbers(self.path)
                if logs:
                    self._wait_logs_below(logs[-1])
        finally:
            self.events.end(reopened)

    def wait_flushed(self) -> None:
        """Wait for every flush started (of every column family but the pin)."""
        for cf in list(self._families.values()):
            self._wait_flushed(cf)

    # ---- the reclaimer --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._reclaim_below is None and not self._stop:
                    self._wake.wait()
                if self._stop:
                    self._idle.set()
                    return
                below, self._reclaim_below = self._reclaim_below, None
                assert below is not None  # the wait above ends on a request or on stop
            try:
                self._reclaim(below)
            except Exception:  # a store closed meanwhile, or an I/O error the next write will meet
                log.warning("deleting the flushed write-ahead logs failed", exc_info=True)
            finally:
                self._idle.set()

    def _reclaim(self, below: int) -> None:
        """Once every memtable switched is flushed, flush the pin (announced): the logs below ``below`` (those
        before the switch) become obsolete; their deletion is waited for inside the announcement."""
        self.wait_flushed()
        assert self._db is not None
        default = self._db.get_column_family("default")
        with self.announced(drops_logs=False):
            default.flush(False)
            self._wait_flushed(default)
            self._wait_logs_below(below)

    def _wait_flushed(self, cf: Rdict) -> None:
        deadline = time.monotonic() + FLUSH_WAIT_S
        while cf.property_int_value("rocksdb.num-immutable-mem-table"):
            if time.monotonic() > deadline:
                log.warning("a RocksDB flush in %s did not finish within %.0f s", self.path, FLUSH_WAIT_S)
                return
            time.sleep(_POLL_S)

    def _wait_logs_below(self, number: int) -> None:
        deadline = time.monotonic() + FLUSH_WAIT_S
        while (logs := wal_numbers(self.path)) and logs[0] < number:
            if time.monotonic() > deadline:
                log.warning("write-ahead logs below %d of %s are still there %.0f s after their flush: %s", number,
                            self.path, FLUSH_WAIT_S, logs)
                return
            time.sleep(_POLL_S)

    def detach(self) -> None:
        """Drop every reference to the store (a reclaim in progress finishes first): RocksDB closes a store only
        once no column family object of it is left."""
        self._idle.wait(FLUSH_WAIT_S)
        self._db = None
        self._families = {}

    def close(self) -> None:
        """Stop the reclaimer (a reclaim in progress finishes first)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(FLUSH_WAIT_S)
            self._thread = None
