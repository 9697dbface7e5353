"""Bootstrap: a replica whose RocksDB is empty restores the newest complete snapshot of each model from the store,
before it opens the store; the update consumer then replays from the snapshot's positions.

A snapshot whose files fail their checksums (or cannot be opened) is skipped with a log line and the next newest is
tried; a model with no usable snapshot starts empty (its consumer replays the topic from the earliest offset).
Progress (bytes restored of the total) is logged and shown by ``/readyz``.

The state of each model's bootstrap is durable, in the store's metadata (``bootstrap:<model>``: pending, done, or
none when it had no usable snapshot): the first snapshot placed carries every model's state (written into it before
it is renamed into place), and each later model's turns done once its tables are adopted. A crash in the middle of
a multi-model bootstrap thus leaves a store that says which models are unfinished: the next start bootstraps those
again (after dropping whatever part of their tables an interrupted adopt left), instead of serving them empty.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hps_service.config.base import VERSION_MARK
from hps_service.errors import HPSError
from hps_service.fleet.bucket import CorruptSnapshotError, SnapshotBucket
from hps_service.tiers.rocksdb.tier import RocksDBTier

log = logging.getLogger(__name__)

_MiB = 1 << 20


@dataclass
class BootstrapProgress:
    """What the bootstrap is doing, for the log and ``/readyz`` (written by one thread, read by others)."""

    state: str = "idle"  # idle | restoring | done | not_needed | failed
    model: str | None = None
    snapshot: str | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    restored: dict[str, str | None] = field(default_factory=dict)  # model -> snapshot id (None: none usable)
    error: str | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._last_log = 0.0

    def transfer(self, done: int, total: int) -> None:
        """A download callback: record and, every few seconds, log the bytes restored."""
        self.bytes_done, self.bytes_total = done, total
        now = time.monotonic()
        with self._lock:
            if now - self._last_log < 2.0 and done < total:
                return
            self._last_log = now
        log.info("bootstrap of %s from snapshot %s: %.1f of %.1f MiB restored", self.model, self.snapshot,
                 done / _MiB, total / _MiB)

    def describe(self) -> str | None:
        """A readiness reason while restoring, else None."""
        if self.state != "restoring":
            return None
        return (f"bootstrapping {self.model} from snapshot {self.snapshot}: {self.bytes_done} of {self.bytes_total} "
                f"bytes restored")

    def view(self) -> dict[str, Any]:
        return {"state": self.state, "model": self.model, "snapshot": self.snapshot, "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total, "restored": dict(self.restored), "error": self.error}


PENDING, DONE, NONE = "pending", "done", "none"
_STATE_PREFIX = "bootstrap:"


def store_is_empty(path: Path) -> bool:
    """True when ``path`` holds no RocksDB, or one without rows, tombstones or log positions."""
    if not (Path(path) / "CURRENT").exists():
        return True
    tier = RocksDBTier(Path(path), block_cache_mb=8)
    try:
        if tier.positions():
            return False
        return all(tier.count(t) == 0 and tier.tombstones(t) == 0 for t in tier.tables())
    finally:
        tier.close()


def bootstrap_states(path: Path) -> dict[str, str]:
    """Each model's bootstrap state as the store at ``path`` records it (empty: no bootstrap made it)."""
    if not (Path(path) / "CURRENT").exists():
        return {}
    tier = RocksDBTier(Path(path), block_cache_mb=8)
    try:
        return _states(tier)
    finally:
        tier.close()


def _states(tier: RocksDBTier) -> dict[str, str]:
    return {k[len(_STATE_PREFIX):]: v.decode() for k, v in tier.metadata(_STATE_PREFIX).items()}


def _set_state(tier: RocksDBTier, model: str, state: str) -> None:
    tier.set_metadata(_STATE_PREFIX + model, state.encode())


def _to_bootstrap(path: Path, models: list[str]) -> list[str] | None:
    """The models to bootstrap: all of them into an empty store, the unfinished ones of an interrupted bootstrap,
    None when the store holds data and no bootstrap of it is unfinished."""
    if store_is_empty(path):
        return list(models)
    unfinished = [m for m, state in bootstrap_states(path).items() if state == PENDING]
    return [m for m in models if m in unfinished] or None


def bootstrap(path: Path, bucket: SnapshotBucket, models: list[str],
              progress: BootstrapProgress) -> dict[str, str | None]:
    """Restore the newest usable snapshot of each of ``models`` into the empty store at ``path`` (or of the models
    an interrupted bootstrap left unfinished); returns ``{model: snapshot id or None}``. Does nothing (state
    ``not_needed``) when the store holds data. Raises UnavailableError when the snapshot store cannot be listed (an
    empty start could then serve stale rows)."""
    path = Path(path)
    for leftover in path.parent.glob(f"{path.name}.restore-*"):  # a bootstrap that a crash interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    todo = _to_bootstrap(path, models)
    if todo is None:
        progress.state = "not_needed"
        log.info("RocksDB at %s holds data: no bootstrap; updates resume from its stored positions", path)
        return {}
    placed = (path / "CURRENT").exists()
    if placed:
        log.warning("RocksDB at %s: the bootstrap of %s did not finish before the last stop; bootstrapping %s "
                    "again", path, ", ".join(todo), "it" if len(todo) == 1 else "them")
    started = time.monotonic()
    progress.state = "restoring"
    try:
        for i, model in enumerate(todo):
            progress.model = model
            progress.restored[model] = None
            for manifest in bucket.list(model):
                tmp = path.parent / f"{path.name}.restore-{uuid.uuid4().hex[:8]}"
                progress.snapshot, progress.bytes_done, progress.bytes_total = manifest["id"], 0, manifest["bytes"]
                log.info("bootstrap of %s: restoring snapshot %s (%.1f MiB, %d rows) from %s", model,
                         manifest["id"], manifest["bytes"] / _MiB,
                         sum(t.get("rows", 0) for t in manifest["tables"].values()), bucket.url)
                try:
                    bucket.download(manifest, tmp, progress.transfer)
                    _check_opens(tmp)
                except (CorruptSnapshotError, _Unopenable) as exc:
                    shutil.rmtree(tmp, ignore_errors=True)
                    log.warning("bootstrap of %s: skipping snapshot %s: %s; trying the next newest", model,
                                manifest["id"], exc)
                    continue
                if not placed:
                    _place(path, tmp, {**dict.fromkeys(todo[:i], NONE), model: DONE,
                                       **dict.fromkeys(todo[i + 1:], PENDING)})
                    placed = True
                else:
                    _adopt(path, tmp, model)
                progress.restored[model] = manifest["id"]
                break
            if progress.restored[model] is None:
                log.warning("bootstrap of %s: no usable snapshot in %s; starting empty, replaying its topic from "
                            "the earliest offset", model, bucket.url)
                if placed:
                    _mark(path, model, NONE)
    except HPSError as exc:
        progress.state, progress.error = "failed", str(exc)
        raise
    progress.state = "done"
    log.info("bootstrap done in %.1f s: %s", time.monotonic() - started,
             ", ".join(f"{m} from {s or 'nothing'}" for m, s in progress.restored.items()))
    return dict(progress.restored)


def _place(path: Path, tmp: Path, states: dict[str, str]) -> None:
    """Make the downloaded snapshot at ``tmp`` the store, carrying every model's bootstrap state (one rename)."""
    tier = RocksDBTier(tmp, block_cache_mb=8)
    try:
        for model, state in states.items():
            _set_state(tier, model, state)
    finally:
        tier.close()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def _adopt(path: Path, tmp: Path, model: str) -> None:
    """Merge the downloaded snapshot of ``model`` (its versions' tables with it) into the store (dropping first
    what of its tables an interrupted adopt left), then mark the model done."""
    tier = RocksDBTier(path)
    try:
        for table in [t for t in tier.tables() if t.startswith((f"{model}.", f"{model}{VERSION_MARK}"))]:
            tier.drop_table(table)
        tier.adopt(tmp)
        _set_state(tier, model, DONE)
    finally:
        tier.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _mark(path: Path, model: str, state: str) -> None:
    tier = RocksDBTier(path, block_cache_mb=8)
    try:
        _set_state(tier, model, state)
    finally:
        tier.close()


class _Unopenable(Exception):
    pass


def _check_opens(path: Path) -> None:
    """A downloaded snapshot opens as a RocksDB store (checksums cannot catch a snapshot written wrong)."""
    try:
        RocksDBTier(path, read_only=True, block_cache_mb=8).close()
    except HPSError as exc:
        raise _Unopenable(f"it does not open as a RocksDB store: {exc}") from None
