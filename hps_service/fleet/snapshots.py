"""Taking snapshots: a RocksDB checkpoint of one model's tables and the log positions they were applied up to,
uploaded to the snapshot store (on request, or every ``persistent.snapshot_interval_s``), the newest N kept."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.engine import LookupEngine
from hps_service.errors import HPSError, InvalidArgumentError, UnavailableError
from hps_service.fleet.bucket import Progress, SnapshotBucket
from hps_service.fleet.positions import positions_to_json
from hps_service.fleet.registrations import registration_key
from hps_service.tiers.base import TierCapability, table_id, tier_can
from hps_service.updates.watermarks import topic_id_key

log = logging.getLogger(__name__)


class Snapshotter:
    """Uploads snapshots of the engine's models to ``bucket``; one at a time.

    ``sources_of(model)`` names the logs the model's rows come from (its update topics): only their positions go
    into the snapshot, so a replica restored from it replays exactly what the snapshot lacks, with the ids of those
    topics (``log_ids``: a replica restores it only if the topic is still the same). ``refuse(model)`` says why the
    model must not be snapshotted now (its rows miss updates the log lost), or None.
    """

    def __init__(
        self,
        engine: LookupEngine,
        bucket: SnapshotBucket,
        work_dir: Path,
        sources_of: Callable[[str], Iterable[str]],
        retain: int = 3,
        refuse: Callable[[str], str | None] = lambda model: None,
    ) -> None:
        self.engine = engine
        self.refuse = refuse
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
        if not tier_can(tier, TierCapability.EXPORT):
            raise UnavailableError("snapshots need persistent.type rocksdb")
        if reason := self.refuse(model):
            raise UnavailableError(f"no snapshot of {model} now: its rows miss updates ({reason})")
        tables = {table_id(model, t.name): t for t in mc.tables}
        sources = set(self.sources_of(model))
        ids = {s: v.decode() for s in sources for v in tier.metadata(topic_id_key(s)).values()}
        with self._lock:
            started = time.monotonic()
            tmp = self.work_dir / f"upload-{model}-{uuid.uuid4().hex[:8]}"
            try:
                info = tier.export(tmp, list(tables), sources,
                                   [registration_key(model), *(topic_id_key(s) for s in sources)])
                described = {
                    t.name: info["tables"].get(tid, {"dim": t.dim, "rows": 0, "tombstones": 0})
                    for tid, t in tables.items()
                }
                manifest = self.bucket.upload(
                    model, tmp,
                    {"tables": described, "positions": positions_to_json(info["positions"]), "log_ids": ids,
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


def summary(manifest: dict[str, Any], url: str) -> dict[str, Any]:
    """What the REST API shows of a snapshot in the store (the manifest without its file list)."""
    return {"id": manifest["id"], "model": manifest["model"], "created_at": manifest["created_at"],
            "bytes": manifest["bytes"], "tables": manifest["tables"], "positions": manifest.get("positions", []),
            "store": url}


class RemoteSnapshots:
    """The snapshot endpoints over the store in object storage (same methods as the local
    ``server.snapshots.SnapshotStore``): create uploads, restore downloads into the local checkpoint directory and
    rewrites the tables from it through the engine."""

    def __init__(self, snapshotter: Snapshotter, local: Any) -> None:
        self.snapshotter = snapshotter
        self.bucket = snapshotter.bucket
        self.local = local

    def create(self, model: str) -> dict[str, Any]:
        return summary(self.snapshotter.take(model), self.bucket.url)

    def list(self, model: str) -> list[dict[str, Any]]:
        """Complete snapshots of ``model``, oldest first."""
        return [summary(m, self.bucket.url) for m in reversed(self.bucket.list(model))]

    def get(self, model: str, snapshot_id: str) -> dict[str, Any]:
        return summary(self.bucket.manifest(model, snapshot_id), self.bucket.url)

    def delete(self, model: str, snapshot_id: str) -> None:
        self.bucket.delete(model, snapshot_id)

    def check_restorable(self, model: str, snapshot_id: str) -> dict[str, Any]:
        """The manifest if its tables match the loaded model's, else InvalidArgumentError."""
        manifest = self.bucket.manifest(model, snapshot_id)
        loaded = {t.name: t.dim for t in self.snapshotter.engine.model(model).tables}
        for name, info in manifest["tables"].items():
            if loaded.get(name) != info["dim"]:
                raise InvalidArgumentError(
                    f"snapshot table '{name}' (dim {info['dim']}) does not match the loaded model "
                    f"({'dim ' + str(loaded[name]) if name in loaded else 'no such table'})")
        return manifest

    def restore(self, model: str, snapshot_id: str, job: Any,
                keys: Callable[[np.ndarray], np.ndarray] | None = None) -> dict[str, Any]:
        """Download the snapshot (checksums verified) beside the local checkpoints, then restore from it (only the
        rows of ``keys``, a mask of the keys to restore, when given)."""
        manifest = self.check_restorable(model, snapshot_id)
        path = self.local.root / snapshot_id
        if not path.is_dir():
            self.local.root.mkdir(parents=True, exist_ok=True)
            self.bucket.download(manifest, path)
            meta = {"id": snapshot_id, "model": model, "created_at": manifest["created_at"], "path": str(path),
                    "tables": {n: {"dim": t["dim"], "rows": t["rows"]} for n, t in manifest["tables"].items()}}
            (self.local.root / f"{snapshot_id}.json").write_text(json.dumps(meta))
        return self.local.restore(model, snapshot_id, job, keys)
