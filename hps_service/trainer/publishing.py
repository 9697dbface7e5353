"""Publishing off the training step: a background thread sends each step's changed rows and waits for the broker.

The training thread takes the changes (a copy of the rows) and hands them over through a bounded queue, so it
waits only when the broker falls that many publishes behind; nothing is dropped. The thread writes the keys to the
journal first (when there is one), sends rows and deletes, and flushes: only then is a publish acknowledged. What
is handed over and not yet acknowledged stays visible (``unacknowledged``), so a checkpoint records it as still to
publish. A failed publish stops the thread; the training thread gets its error at the next call. Other work that
must follow the rows in order (writing the exported tower) runs on the same thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hps_service.errors import UnavailableError
from hps_service.trainer.journal import PublishJournal


class RowPublisher(Protocol):
    """What the trainer needs of a publisher: ``hps_service.updates.Publisher`` or ``LatestRowStore``."""

    def publish(self, table: str, keys: np.ndarray, rows: np.ndarray, version: int | np.ndarray) -> int: ...

    def delete(self, table: str, keys: np.ndarray, version: int | np.ndarray) -> int: ...

    def flush(self) -> None: ...


@dataclass
class TableChanges:
    """One table's part of a publish: keys to delete, keys changed and their rows."""

    deletes: np.ndarray
    keys: np.ndarray
    rows: np.ndarray


@dataclass
class PublishJob:
    """The changes of every table at one version."""

    step: int
    version: int
    tables: dict[str, TableChanges] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(int(c.keys.size) for c in self.tables.values())


class BackgroundPublisher:
    """Sends ``PublishJob``s (and ordered callables) on one thread through a queue of at most ``max_pending``."""

    def __init__(self, publisher: RowPublisher, journal: PublishJournal | None = None, max_pending: int = 4) -> None:
        self.publisher = publisher
        self.journal = journal
        self._queue: queue.Queue[PublishJob | Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._unacked: dict[int, PublishJob] = {}
        self._error: BaseException | None = None
        self.rows_published = 0
        self.rows_deleted = 0
        self.publishes = 0
        self.last_version: int | None = None
        self._thread = threading.Thread(target=self._run, name="row-publisher", daemon=True)
        self._thread.start()

    def submit(self, job: PublishJob | Callable[[], None]) -> None:
        """Hand a publish (or a callable to run after the publishes before it) to the thread; blocks while the
        queue is full."""
        self._raise()
        if isinstance(job, PublishJob):
            with self._lock:
                self._unacked[id(job)] = job
        while True:
            try:
                self._queue.put(job, timeout=0.5)
                return
            except queue.Full:
                self._raise()

    def drain(self) -> None:
        """Wait until everything handed over is done; raise the thread's error if it failed."""
        self._raise()
        done = threading.Event()
        self.submit(done.set)
        while not done.wait(0.5):
            self._raise()
        self._raise()

    def unacknowledged(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """(keys, delete keys) of ``table`` handed over and not yet acknowledged by the broker."""
        with self._lock:
            jobs = [j.tables[table] for j in self._unacked.values() if table in j.tables]
        if not jobs:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        return np.concatenate([c.keys for c in jobs]), np.concatenate([c.deletes for c in jobs])

    def close(self) -> None:
        """Finish what was handed over and stop the thread (raises a publish error)."""
        try:
            if self._thread.is_alive() and self._error is None:
                self.drain()
        finally:
            if self._thread.is_alive():
                self._queue.put(None)
                self._thread.join(timeout=30)

    def _raise(self) -> None:
        if self._error is not None:
            raise UnavailableError(f"publishing rows failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if isinstance(job, PublishJob):
                    self._publish(job)
                else:
                    job()
            except BaseException as exc:  # kept for the training thread: it decides, nothing is lost silently
                self._error = exc
                return

    def _publish(self, job: PublishJob) -> None:
        if self.journal is not None:
            self.journal.append(job.step, {name: (c.keys, c.deletes) for name, c in job.tables.items()})
        deleted = 0
        for name, c in job.tables.items():
            if c.deletes.size:
                self.publisher.delete(name, c.deletes, job.version)
                deleted += int(c.deletes.size)
            if c.keys.size:
                self.publisher.publish(name, c.keys, c.rows, job.version)
        self.publisher.flush()
        with self._lock:
            self._unacked.pop(id(job), None)
            self.rows_published += job.rows
            self.rows_deleted += deleted
            self.publishes += 1
            self.last_version = job.version
