"""The local directory store of snapshots: RocksDB checkpoints of the live store under one directory, each tagged
with the model it was taken for (:class:`hps_service.admin.snapshots.Snapshots` takes, lists and restores them).

A checkpoint is a hard-linked copy of the whole store (cheap, consistent), ``<root>/<id>/``; a ``<root>/<id>.json``
beside it records the model's tables, dims and row counts.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from hps_service.config import ModelConfig
from hps_service.engine.stored_tables import stored_id
from hps_service.errors import HPSError, InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.fleet.bucket import Progress
from hps_service.tiers.base import Tier, TierCapability
from hps_service.tiers.rocksdb.tier import RocksDBTier

SNAPSHOT_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


class DirectoryStore:
    """Checkpoints under ``root``, and their descriptions (see the module docstring)."""

    needs = TierCapability.CHECKPOINT

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _paths(self, snapshot_id: str) -> tuple[Path, Path]:
        if not SNAPSHOT_ID.match(snapshot_id):
            raise InvalidArgumentError(f"invalid snapshot id {snapshot_id!r}")
        return self.root / snapshot_id, self.root / f"{snapshot_id}.json"

    def put(self, tier: Tier, model: ModelConfig, progress: Progress | None = None) -> dict[str, Any]:
        """Checkpoint the whole store now and describe ``model``'s tables in it."""
        snapshot_id = f"{model.name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
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
            ids = {t.name: stored_id(src, model.name, t.name) for t in model.tables}
            tables = {t.name: {"dim": t.dim, "rows": src.count(ids[t.name]) if ids[t.name] in held else 0}
                      for t in model.tables}
        finally:
            src.close()
        meta = {"id": snapshot_id, "model": model.name, "created_at": time.time(), "path": str(path),
                "tables": tables}
        meta_path.write_text(json.dumps(meta))
        return meta

    def list(self, model: str) -> list[dict[str, Any]]:
        """Descriptions of the checkpoints taken for ``model``, oldest first."""
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
        meta: dict[str, Any] = json.loads(meta_path.read_text())
        if meta.get("model") != model:
            raise NotFoundError(f"snapshot '{snapshot_id}' belongs to model '{meta.get('model')}', not '{model}'")
        return meta

    def delete(self, model: str, snapshot_id: str) -> None:
        self.get(model, snapshot_id)
        path, meta_path = self._paths(snapshot_id)
        meta_path.unlink()
        shutil.rmtree(path, ignore_errors=True)

    def view(self, record: dict[str, Any]) -> dict[str, Any]:
        """The REST API shows a checkpoint's description as it is."""
        return record

    def rows_at(self, record: dict[str, Any]) -> Path:
        return Path(record["path"])
