"""A RocksDB store that failed a write heals by reopening once there is room again (issue 27, defect 4).

After a write error (ENOSPC on the write-ahead log, say) RocksDB refuses every later write until ``Resume()``, which
rocksdict does not offer, or a reopen; before, writes kept failing after the space was freed, until a restart, while
liveness passed. Now the tier remembers the error, says it is not healthy (readiness), and the next write that comes
at least ``RETRY_S`` after the last attempt and finds room for what a reopen flushes reopens the store: RocksDB
recovers from its log (a batch whose append failed is dropped whole; it was never acknowledged) and writes resume.
Reads wait at :class:`ReadGate` for the instant of the reopen.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from hps_service.errors import UnavailableError
from hps_service.tiers.rocksdb.flush import Flusher

log = logging.getLogger(__name__)

#: Least time between two reopen attempts, and the room (besides the logs to replay) a reopen needs.
RETRY_S, ROOM_BYTES = 1.0, 4 << 20
#: How long a read waits for a reopen in progress.
REOPEN_WAIT_S = 30.0


class ReadGate:
    """The reads in progress on an open store: a reopen closes the gate, waits for them, then opens it again.
    Re-entrant per thread (a read that calls another read never waits for a reopen that waits for it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._closed = False
        self._depth = threading.local()

    @contextmanager
    def reading(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                if self._closed and not self._cond.wait_for(lambda: not self._closed, REOPEN_WAIT_S):
                    raise UnavailableError(f"RocksDB is being reopened; not done within {REOPEN_WAIT_S:g} s")
                self._readers += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                with self._cond:
                    self._readers -= 1
                    if not self._readers:
                        self._cond.notify_all()

    @contextmanager
    def closed(self) -> Iterator[None]:
        """No read runs inside this block (new ones wait at the gate)."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._readers == 0, REOPEN_WAIT_S)
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


class Gated(Protocol):
    """A store whose reads wait at its :class:`Recovery`'s gate (:class:`RocksDBTier`)."""

    @property
    def _recovery(self) -> Recovery: ...


_S = TypeVar("_S", bound=Gated)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def gated(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """A read of the store: it waits for a reopen in progress (:attr:`Recovery.gate`)."""

    @functools.wraps(method)
    def read(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._recovery.gate.reading():
            return method(self, *args, **kwargs)

    return read


class WriteFailure:
    """The error a store's last write failed with, until a reopen heals it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.error: str | None = None
        self._tried_at = float("-inf")

    def failed(self, exc: BaseException) -> UnavailableError:
        """Note a failed write; the error to raise (the write is not applied, its offsets are not committed)."""
        if self.error is None:  # (the message, not the exception: a record kept would keep its batch alive)
            log.error("RocksDB at %s failed a write: %s; writes are refused until it is reopened, which the next "
                      "write tries once the volume has room again", self.path, str(exc))
        self.error = str(exc)
        self._tried_at = time.monotonic()
        return UnavailableError(f"RocksDB at {self.path} cannot write: {exc}")

    def refusal(self, why: str = "") -> UnavailableError:
        """The error a write gets while the store is not reopened yet."""
        return UnavailableError(f"RocksDB at {self.path} cannot write since: {self.error}; it is reopened once the "
                                f"volume has room again{'; ' + why if why else ''}")

    def due(self, replayed_bytes: int) -> bool:
        """Whether to try a reopen now: ``RETRY_S`` since the last try, and room for what it flushes from the logs
        it replays (``replayed_bytes``: the memtables now; a failed append's torn tail is dropped, not replayed),
        proven by writing that much (a reopen that fails leaves the store closed, and reads refused, until the next)."""
        if time.monotonic() - self._tried_at < RETRY_S:
            return False
        self._tried_at = time.monotonic()
        needed = replayed_bytes + ROOM_BYTES
        probe = self.path / ".hps-room-probe"
        try:
            if shutil.disk_usage(self.path).free < needed:
                raise OSError("not enough free space")
            with open(probe, "wb") as f:
                for _ in range(0, needed, 1 << 20):
                    f.write(bytes(1 << 20))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            log.info("RocksDB at %s: no room for a reopen yet (%d bytes: %s)", self.path, needed, exc)
            return False
        finally:
            probe.unlink(missing_ok=True)
        return True

    def healed(self) -> None:
        log.warning("RocksDB at %s reopened after its write error (%s): writes resume", self.path, self.error)
        self.error = None


class Reopenable(Protocol):
    """What :class:`Recovery` closes and opens again: the tier's store (:class:`RocksDBTier`)."""

    def _open(self) -> None: ...

    def _close_db(self) -> bool: ...

    def _memtable_bytes(self) -> int: ...


class Recovery:
    """A store's way back from a failed write: the error it remembers, whether the store is closed for its reopen
    (``down``), and the gate its reads wait at meanwhile; :meth:`heal` reopens it."""

    def __init__(self, store: Reopenable, path: Path, lock: threading.RLock, flusher: Flusher | None) -> None:
        """``lock``: the store's write lock; ``flusher``: its flush policy (None: read-only, never writes)."""
        self._store = store
        self._lock = lock
        self._flusher = flusher
        self.failure = WriteFailure(path)
        self.gate = ReadGate()
        #: The store failed and is not reopened yet.
        self.down = False

    def heal(self) -> None:
        """After a failed write: reopen the store when due (see :mod:`hps_service.tiers.rocksdb.recovery`), else
        refuse the write."""
        with self._lock:
            if self.failure.error is None:
                return
            if not self.failure.due(0 if self.down else self._store._memtable_bytes()):
                raise self.failure.refusal()
            assert self._flusher is not None
            with self._flusher.announced(reopened=True), self.gate.closed():
                if not self.down:
                    if not self._store._close_db():
                        raise self.failure.refusal("it could not be closed to reopen it (no room yet?)")
                    self.down = True
                try:
                    self._store._open()  # an error leaves it closed (reads refused), tried again when next due
                    self._flusher.mark(self._flusher.families())
                except Exception as exc:  # noqa: BLE001  (still no room, or the store cannot recover yet)
                    raise self.failure.refusal(f"reopening failed: {exc}") from None
                self.down = False
            self.failure.healed()
