"""A tier whose backend could not be reached at start: the server starts degraded and connects in the background.

Until the backend answers, every key is a miss (lookups fall through to the next tier), writes write nothing (the
durable tier below holds them), ``healthy()`` is False (so /readyz says so) and a thread retries the connection
every ``retry_after_s``. Once connected, the tables created meanwhile are created there and every call is passed on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from hps_service.errors import InvalidArgumentError
from hps_service.tiers.base import MissedWrites, Rows, Tier, TierCapability, TierStats

log = logging.getLogger(__name__)


class DeferredTier(Tier):
    """Stands in for the tier ``connect()`` builds until it succeeds; see the module docstring."""

    capabilities = TierCapability.WRITES  # it passes on only the Tier interface, whatever else the backend can do

    def __init__(self, connect: Callable[[], Tier], kind: str, what: str, retry_after_s: float = 1.0) -> None:
        if retry_after_s <= 0:
            raise InvalidArgumentError(f"retry_after_s must be > 0, got {retry_after_s}")
        self.kind = kind
        self.what = what
        self._connect = connect
        self._retry_after_s = retry_after_s
        self._inner: Tier | None = None
        self._dims: dict[str, int] = {}
        self._lock = threading.Lock()
        self._missed = MissedWrites(f"{kind} tier ({what})")
        self._closed = threading.Event()
        self.attempts = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._reconnect_loop, name=f"hps-connect-{kind}", daemon=True)
        self._thread.start()

    def _reconnect_loop(self) -> None:
        while not self._closed.wait(self._retry_after_s):
            self.attempts += 1
            try:
                inner = self._connect()
            except Exception as exc:  # noqa: BLE001  (still unreachable: stay degraded, try again)
                self.last_error = str(exc)
                log.warning("%s still unreachable (attempt %d): %s", self.what, self.attempts, exc)
                continue
            with self._lock:
                if self._closed.is_set():
                    inner.close()
                    return
                try:
                    for table, dim in self._dims.items():
                        inner.create_table(table, dim)
                except Exception as exc:  # noqa: BLE001
                    inner.close()
                    self.last_error = str(exc)
                    log.warning("%s reached but tables not created: %s", self.what, exc)
                    continue
                self._inner = inner
            log.info("%s reachable after %d attempts; the %s tier is in use", self.what, self.attempts, self.kind)
            return

    def create_table(self, table: str, dim: int) -> None:
        with self._lock:
            if self._inner is None:
                if dim <= 0:
                    raise InvalidArgumentError(f"dim of table {table!r} must be positive, got {dim}")
                self._dims[table] = dim
                return
        self._inner.create_table(table, dim)

    def _dim(self, table: str) -> int:
        return self._dims.get(table, 1)

    def get(self, table: str, keys: np.ndarray) -> Rows:
        inner = self._inner
        if inner is not None:
            return inner.get(table, keys)
        return Rows.empty(np.asarray(keys).shape[0], self._dim(table))

    def put(self, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> np.ndarray:
        inner = self._inner
        if inner is not None:
            return inner.put(table, keys, vectors, versions)
        self._missed.add(table, keys)
        return np.zeros(np.asarray(keys).shape[0], dtype=bool)

    def delete(self, table: str, keys: np.ndarray, versions: np.ndarray | None = None) -> int:
        inner = self._inner
        if inner is not None:
            return inner.delete(table, keys, versions) if versions is not None else inner.delete(table, keys)
        self._missed.add(table, keys)
        return 0

    def take_missed_writes(self, table: str) -> np.ndarray:
        """Keys written while the store was unreachable (once it is connected), then the store's own misses."""
        inner = self._inner
        if inner is None:
            return np.empty(0, dtype=np.int64)
        return np.union1d(self._missed.take(table), inner.take_missed_writes(table))

    def count(self, table: str) -> int:
        inner = self._inner
        return inner.count(table) if inner is not None else 0

    def stats(self, table: str) -> TierStats:
        inner = self._inner
        if inner is not None:
            return inner.stats(table)
        return TierStats(rows=0, capacity=None, errors=self.attempts, extra={"connected": 0.0})

    def scan_keys(self, table: str, limit: int) -> np.ndarray:
        inner = self._inner
        return inner.scan_keys(table, limit) if inner is not None else np.empty(0, dtype=np.int64)

    def drop_table(self, table: str) -> None:
        with self._lock:
            if self._inner is None:
                self._dims.pop(table, None)
                return
        self._inner.drop_table(table)

    def healthy(self) -> bool:
        inner = self._inner
        return inner.healthy() if inner is not None else False

    def memory_bytes(self) -> dict[str, int]:
        inner = self._inner
        return inner.memory_bytes() if inner is not None else super().memory_bytes()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        with self._lock:
            inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()
