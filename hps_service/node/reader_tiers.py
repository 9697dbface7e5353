"""The tiers as a process that is not the owner reads them, as read-only tiers (:class:`~hps_service.tiers.base.
ReadTier`: nothing to write with): the shared hash map (lock-free) and RocksDB through a secondary instance that
catches up when the owner's change rings say it must, and trusts a catch-up only when the owner announced no file
change during it (:mod:`hps_service.node.store.l3_events`)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hps_service.config import PersistentConfig
from hps_service.errors import UnavailableError
from hps_service.keys import as_keys
from hps_service.node.store.view import StoreView
from hps_service.shm.changes import ChangeRing
from hps_service.tiers.base import LaneRead, ReadTier, Rows, TierCapability, TierStats
from hps_service.tiers.rocksdb.tier import RocksDBTier

log = logging.getLogger(__name__)

#: How often the background thread catches the secondary up while this worker reads RocksDB (a read within
#: ``READING_S``) and the owner wrote something since. A catch-up costs about 3.5 ms however little it replays, plus
#: about 2 us a row (measured at 10k rows/s of 64 floats: every 20 ms, 0.16 cores per worker; every 0.25 s, 0.04), and
#: it holds the GIL throughout (rocksdict does not release it), stalling the worker's lookups. A read of a key written
#: since catches up itself, so the pace only bounds that read's wait.
CATCH_UP_INTERVAL_S, READING_S = 0.25, 5.0
#: How often the background thread looks at the change rings, and the share of a ring written since the last catch-up
#: at which it catches up whatever the pace (while reading, and while not: a lapped ring means opening the instance
#: afresh, which replays every write-ahead log). A worker that does not read RocksDB (the hash map holds every row)
#: so replays the owner's writes in a few large catch-ups instead of four a second.
RING_POLL_S, RING_SHARE_READING, RING_SHARE_IDLE = 0.02, 0.25, 0.5
#: How long a catch-up waits for the owner to finish an announced file change (a flush's marker, the deletion of
#: flushed logs, an ingest, a reopen: milliseconds, an ingest's flush longer) before the read fails UNAVAILABLE.
ANNOUNCED_WAIT_S, _ANNOUNCED_POLL_S = 30.0, 0.001

#: ``epochs()``: the owner's (files, opens) announcement counters (see :mod:`hps_service.node.store.l3_events`).
Epochs = Callable[[], tuple[int, int]]


class SharedVolatile(ReadTier):
    """The owner's hash-map tier, read lock-free from the shared store."""

    kind = "volatile"
    in_process = True
    capabilities = TierCapability(0)  # read-only: the owner writes

    def __init__(self, view: Callable[[], StoreView]) -> None:
        self._view = view

    def get(self, table: str, keys: np.ndarray) -> Rows:
        keys = as_keys(keys)
        reader = self._view().volatile(table)
        if reader is None:
            return Rows(vectors=np.empty((keys.shape[0], 0), np.float32), versions=np.zeros(keys.shape[0], np.int64),
                        found=np.zeros(keys.shape[0], bool))
        return reader.get(keys)

    def fill(self, table: str, keys: np.ndarray, positions: np.ndarray, out: np.ndarray, versions: np.ndarray,
             found: np.ndarray) -> int:
        reader = self._view().volatile(table)
        if reader is None:
            found.fill(False)
            return 0
        return reader.fill(keys, positions, out, versions, found)

    def lane(self, table: str) -> LaneRead | None:
        reader = self._view().volatile(table)
        return None if reader is None else reader.lane()

    def close(self) -> None:
        return None


class CaughtUpSecondary(ReadTier):
    """RocksDB read through a secondary instance of the owner's primary. Before a read, the keys the owner wrote
    since this instance's last catch-up (its change ring) are checked against the keys asked: if any is among them
    the instance catches up first, so a read never misses a write acknowledged before it began. While this process
    reads RocksDB, a background thread catches up every ``CATCH_UP_INTERVAL_S`` while the owner writes, which keeps
    that check and that catch-up short; otherwise only before a ring laps.

    A catch-up during which the owner changed files it could not follow (``epochs``' files counter odd, or moved)
    may keep rows replayed from before a flush (RocksDB 10.4; see :mod:`hps_service.tiers.rocksdb.flush`): it is
    made again once the owner is done, and the instance is opened afresh when the owner reopened its store."""

    kind = "persistent"
    capabilities = TierCapability(0)  # read-only: the owner writes, snapshots and imports

    def __init__(self, cfg: PersistentConfig, rings: Callable[[], dict[str, ChangeRing]],
                 block_cache_mb: int, epochs: Epochs | None = None) -> None:
        self._cfg = cfg
        self._rings = rings
        self._epochs: Epochs = epochs or (lambda: (0, 0))
        self._opens = -1  # the owner's reopens this instance has seen
        self._block_cache_mb = block_cache_mb
        self._dir = Path(tempfile.mkdtemp(prefix="hps-secondary-"))
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()  # one refresh at a time: readers that found the same keys stale share it
        self._caught: dict[int, int] = {}  # id(ring) -> position caught up to
        self._caught_at = 0.0
        self._read_at = float("-inf")  # when this process last read RocksDB
        self._readers = threading.Condition()
        self._reading: dict[int, int] = {}  # id(instance) -> reads in progress on it
        self._db = self._open()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hps-l3-catch-up", daemon=True)
        self._thread.start()

    def _open(self) -> RocksDBTier:
        rings = self._rings()
        positions = {id(r): r.position() for r in rings.values()}
        opens = self._epochs()[1]
        db = RocksDBTier(self._cfg.path, block_cache_mb=self._block_cache_mb, secondary_path=self._dir)
        self._caught, self._caught_at, self._opens = positions, time.monotonic(), opens
        return db

    def reopen(self) -> None:
        """Open a fresh instance (the owner created tables this one cannot see, or reopened its store), trusted as a
        catch-up is (:meth:`_refresh_locked`); the old one is closed once the reads still using it are done."""
        with self._refreshing:
            self._swap()
            self._refresh_locked()

    def _swap(self) -> None:
        with self._lock:
            old, self._db = self._db, self._open()
        with self._readers:
            self._readers.wait_for(lambda: not self._reading.get(id(old)), timeout=30)
        old.close()

    def tables(self) -> dict[str, int]:
        return self._db.tables()

    def catch_up(self) -> None:
        with self._lock:
            rings = self._rings()
            positions = {id(r): r.position() for r in rings.values()}
            self._db.catch_up()
            self._caught.update(positions)
            self._caught_at = time.monotonic()

    def refresh(self) -> None:
        """Catch up with the primary (open afresh when the owner reopened it), trusted as :meth:`_refresh_locked`
        says."""
        with self._refreshing:
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        """Catch up until a catch-up ran entirely outside the owner's announced file changes: one that overlapped
        a flush may keep rows from before it, the next replays the flush's marker and drops them."""
        deadline = time.monotonic() + ANNOUNCED_WAIT_S
        while True:
            epochs = self._settled(deadline)
            if epochs[1] != self._opens:
                self._swap()
            else:
                self.catch_up()
            if self._epochs() == epochs:
                return

    def _settled(self, deadline: float) -> tuple[int, int]:
        """The owner's counters once no file change is announced (files counter even)."""
        while (epochs := self._epochs())[0] % 2:
            if time.monotonic() > deadline:
                raise UnavailableError(f"the owner's RocksDB at {self._cfg.path} is changing files for more than "
                                       f"{ANNOUNCED_WAIT_S:g} s; try again")
            time.sleep(_ANNOUNCED_POLL_S)
        return epochs

    def _stale(self, table: str, keys: np.ndarray) -> bool:
        ring = self._rings().get(table)
        if ring is None:
            return False
        since = self._caught.get(id(ring))
        return since is None or ring.stale(since, keys)

    def _due(self) -> bool:
        """Whether the background thread should catch up now: the owner reopened its store, a ring filled its share
        since the last catch-up (or is new to this instance), or this process reads RocksDB, the owner wrote since
        and ``CATCH_UP_INTERVAL_S`` passed."""
        now = time.monotonic()
        if self._epochs()[1] != self._opens:
            return True
        reading = now - self._read_at < READING_S
        share = RING_SHARE_READING if reading else RING_SHARE_IDLE
        behind = False
        for r in self._rings().values():
            since = self._caught.get(id(r))
            if since is None:
                return True
            written = r.position() - since
            if written >= r.size * share:
                return True
            behind = behind or written > 0
        return behind and reading and now - self._caught_at >= CATCH_UP_INTERVAL_S

    def _loop(self) -> None:
        while not self._stop.wait(RING_POLL_S):
            try:
                if self._due():
                    self.refresh()
            except Exception:  # the read path catches up itself when it must
                log.debug("background catch-up failed", exc_info=True)

    def get(self, table: str, keys: np.ndarray) -> Rows:
        keys = as_keys(keys)
        self._read_at = time.monotonic()
        if self._stale(table, keys):
            with self._refreshing:
                if self._stale(table, keys):  # a refresh that ran while this read waited may have covered its keys
                    self._refresh_locked()
        with self._readers:
            db = self._db
            self._reading[id(db)] = self._reading.get(id(db), 0) + 1
        try:
            return db.get(table, keys)
        finally:
            with self._readers:
                left = self._reading[id(db)] - 1
                if left:
                    self._reading[id(db)] = left
                else:
                    del self._reading[id(db)]
                    self._readers.notify_all()

    def count(self, table: str) -> int:
        return self._db.count(table)

    def stats(self, table: str) -> TierStats:
        return self._db.stats(table)

    def memory_bytes(self) -> dict[str, int]:
        """The secondary's memtables (replayed from the primary's WAL) and block cache, in bytes."""
        return self._db.memory_bytes()

    def healthy(self) -> bool:
        return self._db.healthy()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1)
        self._db.close()
        shutil.rmtree(self._dir, ignore_errors=True)
