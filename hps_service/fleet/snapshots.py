"""Taking snapshots: a RocksDB checkpoint of one model's tables and the log positions they were applied up to,
uploaded to the snapshot store (on request, or every ``persistent.snapshot_interval_s``), the newest N kept."""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hps_service.engine import LookupEngine
from hps_service.errors import HPSError, UnavailableError
from hps_service.fleet.positions import positions_to_json
from hps_service.fleet.registrations import registration_key
from hps_service.fleet.store import Progress, SnapshotBucket
from hps_service.tiers.base import table_id
from hps_service.tiers.rocksdb import RocksDBTier

log = logging.getLogger(__name__)


class Snapshotter:
    """Uploads snapshots of the engine's models to ``bucket``; one at a time.

    ``sources_of(model)`` names the logs the model's rows come from (its update topics): only their positions go
    into the snapshot, so a replica restored from it replays exactly what the snapshot lacks.
    """

    def __init__(
        self,
        engine: LookupEngine,
        bucket: SnapshotBucket,
        work_dir: Path,
        sources_of: Callable[[str], Iterable[str]],
        retain: int = 3,
    ) -> None:
        self.engine = engine
        self.bucket = bucket
        self.work_dir = Path(work_dir)
        self.sources_of = sources_of
        self.retain = retain
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    def take(self, model: str, progress: Progress | None = None) -> dict[str, Any]:
        """Checkpoint ``model``'s tables, upload them with the manifest last, drop snapshots beyond ``retain``;
        returns the manifest."""
        mc = self.engine.model(model)
        tier = self.engine.persistent
        if not isinstance(tier, RocksDBTier):
            raise UnavailableError("snapshots need persistent.type rocksdb")
        tables = {table_id(model, t.name): t for t in mc.tables}
        with self._lock:
            started = time.monotonic()
            tmp = self.work_dir / f"upload-{model}-{uuid.uuid4().hex[:8]}"
            try:
                info = tier.export(tmp, list(tables), set(self.sources_of(model)), [registration_key(model)])
                described = {
                    t.name: info["tables"].get(tid, {"dim": t.dim, "rows": 0, "tombstones": 0})
                    for tid, t in tables.items()
                }
                manifest = self.bucket.upload(
                    model, tmp,
                    {"tables": described, "positions": positions_to_json(info["positions"]),
                     "model_config": mc.model_dump(mode="json")},
                    progress,
                )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            dropped = self.bucket.retain(model, self.retain)
        log.info("snapshot %s of %s uploaded to %s: %d rows, %.1f MiB in %.1f s%s", manifest["id"], model,
                 self.bucket.url, sum(t["rows"] for t in described.values()), manifest["bytes"] / (1 << 20),
                 time.monotonic() - started, f"; deleted {len(dropped)} older" if dropped else "")
        return manifest

    def start(self, interval_s: float) -> None:
        """Snapshot every loaded model every ``interval_s`` seconds in a background thread."""
        if interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="hps-snapshots", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the periodic thread (an upload in progress finishes first, within ``timeout``)."""
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
