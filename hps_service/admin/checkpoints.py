"""Model snapshots: RocksDB checkpoints taken on the live store, listed per model, restored row by row.

A checkpoint is a hard-linked copy of the whole store (cheap, consistent). It is tagged with the model it was
taken for, and a ``<id>.json`` beside it records the model's tables, dims and row counts.

Restore does not swap files under the open DB (RocksDB cannot replace a live column family in place). It opens
the checkpoint read-only and writes its rows back through the engine, in chunks, so every tier and L1 stays
consistent: rows whose live version is newer than the snapshot's are deleted first (versioned writes would keep
them otherwise), the snapshot's rows are written with their own versions, and live keys that the snapshot did
not hold are deleted. Lookups keep being served meanwhile; a key rewritten in a chunk may answer with its
default for the instant between that chunk's delete and its write, and updates applied during a restore may be
overwritten by it. Stop the update stream while restoring if that matters.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.admin.jobs import Job, writable_persistent
from hps_service.engine import LookupEngine
from hps_service.errors import HPSError, InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.tiers.base import TierCapability, table_id, tier_can
from hps_service.tiers.rocksdb.tier import RocksDBTier

SNAPSHOT_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
#: Rows written back per engine call during a restore.
RESTORE_CHUNK = 16_384


class SnapshotStore:
    """Creates, lists, deletes and restores checkpoints under one directory."""

    def __init__(self, engine: LookupEngine, root: Path) -> None:
        self.engine = engine
        self.root = Path(root)

    def _paths(self, snapshot_id: str) -> tuple[Path, Path]:
        if not SNAPSHOT_ID.match(snapshot_id):
            raise InvalidArgumentError(f"invalid snapshot id {snapshot_id!r}")
        return self.root / snapshot_id, self.root / f"{snapshot_id}.json"

    def create(self, model: str) -> dict[str, Any]:
        """Checkpoint the store now; returns the snapshot's description."""
        mc = self.engine.model(model)
        tier = self.engine.persistent
        if not tier_can(tier, TierCapability.CHECKPOINT):
            raise UnavailableError("snapshots need persistent.type rocksdb")
        snapshot_id = f"{model}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
        path, meta_path = self._paths(snapshot_id)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            tier.checkpoint(path)
        except HPSError:
            raise
        except Exception as exc:  # rocksdict raises bare Exception for I/O errors
            shutil.rmtree(path, ignore_errors=True)
            raise UnavailableError(f"cannot checkpoint the store into {path}: {exc}") from exc
        src = RocksDBTier(path, read_only=True, block_cache_mb=0)
        try:
            held = src.tables()
            tables = {
                t.name: {"dim": t.dim, "rows": src.count(table_id(model, t.name)) if table_id(model, t.name) in held else 0}
                for t in mc.tables
            }
        finally:
            src.close()
        meta = {"id": snapshot_id, "model": model, "created_at": time.time(), "path": str(path), "tables": tables}
        meta_path.write_text(json.dumps(meta))
        return meta

    def list(self, model: str) -> list[dict[str, Any]]:
        """Snapshots taken for ``model``, oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for meta_path in self.root.glob("*.json"):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            if meta.get("model") == model and Path(meta.get("path", "")).is_dir():
                out.append(meta)
        return sorted(out, key=lambda m: m["created_at"])

    def get(self, model: str, snapshot_id: str) -> dict[str, Any]:
        path, meta_path = self._paths(snapshot_id)
        if not meta_path.is_file() or not path.is_dir():
            raise NotFoundError(f"no snapshot '{snapshot_id}'")
        meta = json.loads(meta_path.read_text())
        if meta.get("model") != model:
            raise NotFoundError(f"snapshot '{snapshot_id}' belongs to model '{meta.get('model')}', not '{model}'")
        return meta

    def delete(self, model: str, snapshot_id: str) -> None:
        self.get(model, snapshot_id)
        path, meta_path = self._paths(snapshot_id)
        meta_path.unlink()
        shutil.rmtree(path, ignore_errors=True)

    def check_restorable(self, model: str, snapshot_id: str) -> dict[str, Any]:
        """The snapshot's description if its tables match the loaded model's, else InvalidArgumentError."""
        meta = self.get(model, snapshot_id)
        writable_persistent(self.engine, "restore", TierCapability.CHECKPOINT)
        loaded = {t.name: t.dim for t in self.engine.model(model).tables}
        for name, info in meta["tables"].items():
            if loaded.get(name) != info["dim"]:
                raise InvalidArgumentError(
                    f"snapshot table '{name}' (dim {info['dim']}) does not match the loaded model "
                    f"({'dim ' + str(loaded[name]) if name in loaded else 'no such table'})"
                )
        return meta

    def restore(self, model: str, snapshot_id: str, job: Job,
                keys: Callable[[np.ndarray], np.ndarray] | None = None) -> dict[str, Any]:
        """Make the model's tables hold exactly the snapshot's rows (see the module docstring for the limits); with
        ``keys`` (a mask of the keys to restore) only those keys' rows, the others left as they are."""
        meta = self.check_restorable(model, snapshot_id)
        live = writable_persistent(self.engine, "restore", TierCapability.CHECKPOINT)
        job.rows_total = int(sum(info["rows"] for info in meta["tables"].values()))
        src = RocksDBTier(Path(meta["path"]), read_only=True, block_cache_mb=8)
        result: dict[str, Any] = {"snapshot": snapshot_id, "tables": {}}
        try:
            held = src.tables()
            for name in meta["tables"]:
                tid = table_id(model, name)
                snap_keys = src.scan_keys(tid, src.count(tid)) if tid in held else np.zeros(0, dtype=np.int64)
                if keys is not None:
                    snap_keys = snap_keys[keys(snap_keys)]
                for start in range(0, snap_keys.shape[0], RESTORE_CHUNK):
                    chunk = snap_keys[start : start + RESTORE_CHUNK]
                    rows = src.get(tid, chunk)
                    current = live.get(tid, chunk)
                    # live rows newer than the snapshot, and tombstones (reported as not found), would refuse the
                    # snapshot's older versions: forget them first (an unversioned delete also clears tombstones)
                    newer = ~current.found | (current.versions > rows.versions)
                    if newer.any():
                        self.engine.apply_deletes(model, name, chunk[newer])
                    self.engine.apply_updates(model, name, chunk, rows.vectors, rows.versions)
                    job.rows_done += int(chunk.shape[0])
                live_keys = live.scan_keys(tid, live.count(tid) + RESTORE_CHUNK)
                if keys is not None:
                    live_keys = live_keys[keys(live_keys)]
                extra = live_keys[~np.isin(live_keys, snap_keys)]
                for start in range(0, extra.shape[0], RESTORE_CHUNK):
                    self.engine.apply_deletes(model, name, extra[start : start + RESTORE_CHUNK])
                t = self.engine.table(model, name)
                if t.cache is not None:
                    t.cache.clear()
                result["tables"][name] = {
                    "rows_restored": int(snap_keys.shape[0]),
                    "rows_deleted": int(extra.shape[0]),
                    "rows_stored": live.count(tid),
                }
        finally:
            src.close()
        return result
