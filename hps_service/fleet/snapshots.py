"""The bucket store of snapshots: a RocksDB export of one model's tables and the log positions they were applied up
to, uploaded to the object-storage bucket (:mod:`hps_service.fleet.bucket`), the newest N kept
(:class:`hps_service.admin.snapshots.Snapshots` takes, lists and restores them)."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hps_service.config import ModelConfig
from hps_service.engine.stored_tables import metadata_keys, stored_id, stored_table
from hps_service.engine.versions import label_keys
from hps_service.errors import UnavailableError
from hps_service.fleet.bucket import Progress, SnapshotBucket
from hps_service.fleet.positions import positions_to_json
from hps_service.fleet.registrations import load_registrations, registration_key
from hps_service.tiers.base import Tier, TierCapability
from hps_service.updates.watermarks import topic_id_key

log = logging.getLogger(__name__)


class BucketStore:
    """Snapshots in ``bucket``; ``work_dir`` holds an export while it uploads and the downloads restored from.

    ``sources_of(model)`` names the logs the model's rows come from (its update topics): only their positions go
    into the snapshot, so a replica restored from it replays exactly what the snapshot lacks, with the ids of those
    topics (``log_ids``: a replica restores it only if the topic is still the same).
    """

    needs = TierCapability.EXPORT

    def __init__(self, bucket: SnapshotBucket, work_dir: Path, sources_of: Callable[[str], Iterable[str]],
                 retain: int = 3) -> None:
        self.bucket = bucket
        self.work_dir = Path(work_dir)
        self.sources_of = sources_of
        self.retain = retain

    def put(self, tier: Tier, model: ModelConfig, progress: Progress | None = None) -> dict[str, Any]:
        """Export ``model``'s tables, upload them with the manifest last, drop snapshots beyond ``retain``;
        returns the manifest."""
        # the model and its versions (registered at runtime: their records say which), each with its labels
        served = [model, *(v for v in load_registrations(tier) if v.name == model.name and v.version)]
        stored = {(m.served_name, t.name): stored_table(tier, m.served_name, t.name) for m in served for t in m.tables}
        tables = {stored[(m.served_name, t.name)].id: (m, t) for m in served for t in m.tables}
        sources = set(self.sources_of(model.name))
        ids = {s: v.decode() for s in sources for v in tier.metadata(topic_id_key(s)).values()}
        started = time.monotonic()
        tmp = self.work_dir / f"upload-{model.name}-{uuid.uuid4().hex[:8]}"
        try:
            info = tier.export(tmp, list(tables), sources,
                               [*(registration_key(m.served_name) for m in served),
                                *(topic_id_key(s) for s in sources), *label_keys(tier, model.name),
                                *(k for m in served for k in metadata_keys(
                                    m.served_name, {t.name: stored[(m.served_name, t.name)] for t in m.tables}))])
            if {stored_id(tier, m.served_name, t.name) for m in served for t in m.tables} != set(tables):
                raise UnavailableError(f"a table of {model.name} was converted while it was exported; snapshot "
                                       "it again")

            def described(m: ModelConfig) -> dict[str, Any]:  # dim: the model's (the store's: the row's words)
                return {t.name: {**info["tables"].get(tid, {"rows": 0, "tombstones": 0}), "dim": t.dim,
                                 "storage": stored[(m.served_name, t.name)].serving_storage(t.storage)}
                        for tid, (of, t) in tables.items() if of is m}

            manifest = self.bucket.upload(
                model.name, tmp,
                {"tables": described(model), "positions": positions_to_json(info["positions"]), "log_ids": ids,
                 "model_config": model.model_dump(mode="json"),
                 "versions": {str(m.version): described(m) for m in served[1:]}},
                progress,
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        dropped = self.bucket.retain(model.name, self.retain)
        log.info("snapshot %s of %s uploaded to %s: %d rows, %.1f MiB in %.1f s%s", manifest["id"], model.name,
                 self.bucket.url, sum(t["rows"] for t in manifest["tables"].values()), manifest["bytes"] / (1 << 20),
                 time.monotonic() - started, f"; deleted {len(dropped)} older" if dropped else "")
        return manifest

    def list(self, model: str) -> list[dict[str, Any]]:
        """Manifests of the complete snapshots of ``model``, oldest first."""
        return list(reversed(self.bucket.list(model)))

    def get(self, model: str, snapshot_id: str) -> dict[str, Any]:
        return self.bucket.manifest(model, snapshot_id)

    def delete(self, model: str, snapshot_id: str) -> None:
        self.bucket.delete(model, snapshot_id)

    def view(self, record: dict[str, Any]) -> dict[str, Any]:
        """What the REST API shows of a snapshot in the bucket (the manifest without its file list)."""
        return {"id": record["id"], "model": record["model"], "created_at": record["created_at"],
                "bytes": record["bytes"], "tables": record["tables"], "positions": record.get("positions", []),
                "store": self.bucket.url}

    def rows_at(self, record: dict[str, Any]) -> Path:
        """The snapshot downloaded (checksums verified) into ``work_dir``, unless an earlier restore left it there."""
        path: Path = self.work_dir / record["id"]
        if not path.is_dir():
            self.work_dir.mkdir(parents=True, exist_ok=True)
            self.bucket.download(record, path)
        return path


class BucketSnapshots(Protocol):
    """The snapshot system over a :class:`BucketStore` (``admin.snapshots.Snapshots``), as the recovery of lost
    partitions uses it."""

    @property
    def store(self) -> BucketStore: ...

    def restore(self, model: str, snapshot_id: str, job: Any,
                keys: Callable[[np.ndarray], np.ndarray] | None = None) -> dict[str, Any]: ...
