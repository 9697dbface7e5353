"""The one snapshot system: takes, lists, deletes and restores snapshots of a model's tables in one store (a local
directory, :mod:`hps_service.admin.checkpoints`, or the bucket, :mod:`hps_service.fleet.snapshots`).

Restore does not swap files under the open DB (RocksDB cannot replace a live column family in place). It opens
the snapshot's RocksDB read-only and writes its rows back through the engine, in chunks, so every tier and L1 stays
consistent: rows whose live version is newer than the snapshot's are deleted first (versioned writes would keep
them otherwise), the snapshot's rows are written with their own versions, and live keys that the snapshot did
not hold are deleted. Lookups keep being served meanwhile; a key rewritten in a chunk may answer with its
default for the instant between that chunk's delete and its write, and updates applied during a restore may be
overwritten by it. Stop the update stream while restoring if that matters.

Rows of a table with ``ttl_s`` keep the write times the snapshot stored with them (a restored row lives no longer
than it would have); a snapshot taken before the table had ``ttl_s`` has none, and its rows are stamped with the
time of the restore.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from hps_service.admin.jobs import writable_persistent
from hps_service.config import ModelConfig
from hps_service.engine.api import Engine
from hps_service.engine.stored_tables import stored_table
from hps_service.errors import HPSError, InvalidArgumentError, UnavailableError
from hps_service.fleet.bucket import Progress
from hps_service.rows import row_format
from hps_service.tiers.base import Tier, TierCapability, tier_can
from hps_service.tiers.rocksdb.tier import RocksDBTier

log = logging.getLogger(__name__)

#: Rows written back per engine call during a restore.
RESTORE_CHUNK = 16_384


class SnapshotStore(Protocol):
    """Where snapshots are kept. A record is the store's description of one snapshot: ``id``, ``model``,
    ``created_at`` and ``tables`` (``{name: {"dim", "rows", ...}}``) at least."""

    #: What taking a snapshot needs of the persistent tier (CHECKPOINT: the whole store; EXPORT: tables with
    #: their log positions).
    needs: TierCapability

    def put(self, tier: Tier, model: ModelConfig, progress: Progress | None) -> dict[str, Any]:
        """Take a snapshot of ``model``'s tables from ``tier`` and keep it; its record."""

    def list(self, model: str) -> list[dict[str, Any]]:
        """Records of the snapshots of ``model``, oldest first."""

    def get(self, model: str, snapshot_id: str) -> dict[str, Any]:
        """The record of one snapshot; NotFoundError or InvalidArgumentError."""

    def delete(self, model: str, snapshot_id: str) -> None:
        """Remove one snapshot; NotFoundError when there is none."""

    def view(self, record: dict[str, Any]) -> dict[str, Any]:
        """What the REST API shows of a snapshot."""

    def rows_at(self, record: dict[str, Any]) -> Path:
        """A local directory holding the snapshot's RocksDB (fetched first when the store is remote)."""


S = TypeVar("S", bound=SnapshotStore)


class Snapshots(Generic[S]):
    """Snapshots of the engine's models in ``store``, taken one at a time (on request, or every ``interval_s``
    once :meth:`start` ed). ``refuse(model)`` says why the model must not be snapshotted now (its rows miss updates
    the log lost), or None."""

    def __init__(self, engine: Engine, store: S,
                 refuse: Callable[[str], str | None] = lambda model: None) -> None:
        self.engine = engine
        self.store = store
        self.refuse = refuse
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    # ---- take, list, delete ---------------------------------------------------------------------
    def take(self, model: str, progress: Progress | None = None) -> dict[str, Any]:
        """Snapshot ``model``'s tables into the store now; returns the store's record of it."""
        mc = self.engine.model(model)
        tier = self.engine.persistent
        if not tier_can(tier, self.store.needs):
            raise UnavailableError("snapshots need persistent.type rocksdb")
        if reason := self.refuse(model):
            raise UnavailableError(f"no snapshot of {model} now: its rows miss updates ({reason})")
        with self._lock:
            return self.store.put(tier, mc, progress)

    def create(self, model: str) -> dict[str, Any]:
        """Snapshot ``model`` now; what the REST API shows of it."""
        return self.store.view(self.take(model))

    def list(self, model: str) -> list[dict[str, Any]]:
        """Snapshots of ``model``, oldest first."""
        return [self.store.view(record) for record in self.store.list(model)]

    def get(self, model: str, snapshot_id: str) -> dict[str, Any]:
        return self.store.view(self.store.get(model, snapshot_id))

    def delete(self, model: str, snapshot_id: str) -> None:
        self.store.delete(model, snapshot_id)

    # ---- restore --------------------------------------------------------------------------------
    def check_restorable(self, model: str, snapshot_id: str) -> dict[str, Any]:
        """The snapshot's record if its tables match the loaded model's, else InvalidArgumentError."""
        record = self.store.get(model, snapshot_id)
        writable_persistent(self.engine, "restore", TierCapability.CHECKPOINT)
        loaded = {t.name: t.dim for t in self.engine.model(model).tables}
        for name, info in record["tables"].items():
            if loaded.get(name) != info["dim"]:
                raise InvalidArgumentError(
                    f"snapshot table '{name}' (dim {info['dim']}) does not match the loaded model "
                    f"({'dim ' + str(loaded[name]) if name in loaded else 'no such table'})"
                )
        return record

    def restore(self, model: str, snapshot_id: str, job: Any,
                keys: Callable[[np.ndarray], np.ndarray] | None = None) -> dict[str, Any]:
        """Make the model's tables hold exactly the snapshot's rows (see the module docstring for the limits); with
        ``keys`` (a mask of the keys to restore) only those keys' rows, the others left as they are. ``job``: what
        reports the progress (``rows_total``, ``rows_done``)."""
        record = self.check_restorable(model, snapshot_id)
        live = writable_persistent(self.engine, "restore", TierCapability.CHECKPOINT)
        path = self.store.rows_at(record)
        job.rows_total = int(sum(info["rows"] for info in record["tables"].values()))
        src = RocksDBTier(path, read_only=True, block_cache_mb=8)
        result: dict[str, Any] = {"snapshot": snapshot_id, "tables": {}}
        try:
            held = src.tables()
            for name in record["tables"]:
                result["tables"][name] = self._restore_table(model, name, src, live, held, job, keys)
        finally:
            src.close()
        return result

    def _restore_table(self, model: str, name: str, src: RocksDBTier, live: Tier, held: dict[str, int], job: Any,
                       keys: Callable[[np.ndarray], np.ndarray] | None) -> dict[str, int]:
        t = self.engine.table(model, name)
        tid = t.id  # jobs run one at a time: no conversion moves the table during a restore
        snap = stored_table(src, model, name)
        # rows as the snapshot stored them (absent a record: fp32 when a row is the table's width, else its format)
        storage = snap.storage or ("fp32" if held.get(snap.id) == t.dim else t.storage)
        unstamped = row_format(storage, t.dim)
        snap_format = row_format(storage, t.dim, stamped=held.get(snap.id) == unstamped.words + 1)  # write times
        snap_keys = src.scan_keys(snap.id, src.count(snap.id)) if snap.id in held else np.zeros(0, dtype=np.int64)
        if keys is not None:
            snap_keys = snap_keys[keys(snap_keys)]
        for start in range(0, snap_keys.shape[0], RESTORE_CHUNK):
            chunk = snap_keys[start : start + RESTORE_CHUNK]
            rows = src.get(snap.id, chunk)
            current = live.get(tid, chunk)
            # live rows newer than the snapshot, and tombstones (reported as not found), would refuse the
            # snapshot's older versions: forget them first (an unversioned delete also clears tombstones)
            newer = ~current.found | (current.versions > rows.versions)
            if newer.any():
                self.engine.apply_deletes(model, name, chunk[newer])
            written = snap_format.stamps(rows.vectors) if snap_format.stamped else None
            self.engine.apply_updates(model, name, chunk, snap_format.decoded(rows.vectors), rows.versions, written)
            job.rows_done += int(chunk.shape[0])
        live_keys = live.scan_keys(tid, live.count(tid) + RESTORE_CHUNK)
        if keys is not None:
            live_keys = live_keys[keys(live_keys)]
        extra = live_keys[~np.isin(live_keys, snap_keys)]
        for start in range(0, extra.shape[0], RESTORE_CHUNK):
            self.engine.apply_deletes(model, name, extra[start : start + RESTORE_CHUNK])
        if t.cache is not None:
            t.cache.clear()
        return {"rows_restored": int(snap_keys.shape[0]), "rows_deleted": int(extra.shape[0]),
                "rows_stored": live.count(tid)}

    # ---- periodic -------------------------------------------------------------------------------
    def start(self, interval_s: float) -> None:
        """Snapshot every loaded model every ``interval_s`` seconds in a background thread."""
        if interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="hps-snapshots", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the periodic thread (a snapshot in progress finishes first, within ``timeout``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            for mc in self.engine.models():
                if self._stop.is_set():
                    return
                try:
                    self.take(mc.name)
                    self.last_error = None
                except HPSError as exc:
                    self.last_error = f"snapshot of {mc.name} failed: {exc}"
                    log.warning("%s", self.last_error)
                except Exception:  # the next round tries again; serving never depends on this thread
                    self.last_error = f"snapshot of {mc.name} failed; see the log"
                    log.exception("snapshot of %s failed", mc.name)
