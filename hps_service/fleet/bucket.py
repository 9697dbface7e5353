"""Snapshots in object storage (S3 and compatibles, through boto3): upload with checksums, manifest last, list the
complete ones, download and verify, keep the newest N.

Layout under ``s3://BUCKET/PREFIX``: ``<model>/<snapshot id>/files/<file>`` for the files of a RocksDB checkpoint and
``<model>/<snapshot id>/manifest.json``, written after every file is uploaded. A snapshot without its manifest is
never listed or restored, so an upload that dies half-way leaves nothing usable behind. Snapshot ids start with a
UTC timestamp, so their order is their age. The endpoint and credentials come from the standard AWS environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, IRSA's web identity, ...), or from ``persistent.s3_*`` keys (files of a
mounted Secret). A manifest names only RocksDB files of its own directory (:mod:`hps_service.fleet.manifests`), and
a download writes no more bytes per file than the manifest gives it.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError

from hps_service.config import PersistentConfig
from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.fleet.fetch import fetch_exact
from hps_service.fleet.manifests import (
    MAX_MANIFEST_BYTES,
    CorruptSnapshotError,
    check_fits,
    check_manifest_files,
    file_target,
    uploaded_files,
)
from hps_service.fleet.s3_files import s3_client, s3_errors

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: Manifest format written by this version; newer formats are skipped by older readers.
FORMAT = 1
SNAPSHOT_ID = re.compile(r"^\d{8}T\d{6}(\d{3})?Z-[0-9a-f]{8}$")
_S3_URL = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")
#: Bytes read per step when hashing a file.
_HASH_CHUNK = 4 << 20
#: (bytes done, bytes total) -> None; called as a transfer progresses.
Progress = Callable[[int, int], None]

__all__ = ["MANIFEST", "CorruptSnapshotError", "Progress", "SnapshotBucket", "new_snapshot_id", "parse_store_url",
           "sha256_file"]


def parse_store_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` as (bucket, prefix without slashes at its ends)."""
    m = _S3_URL.match(url)
    if m is None:
        raise InvalidArgumentError(f"snapshot store {url!r} is not s3://BUCKET[/PREFIX]")
    return m["bucket"], (m["prefix"] or "").strip("/")


def new_snapshot_id() -> str:
    """A snapshot id that sorts by creation time: ``YYYYmmddTHHMMSSmmmZ-<8 hex>``."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now * 1000) % 1000:03d}Z-{uuid.uuid4().hex[:8]}"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class _Counter:
    """Thread-safe byte counter for boto3 transfer callbacks (they run on the transfer threads)."""

    total: int
    done: int = 0
    report: Progress | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            done = self.done
        if self.report is not None:
            self.report(done, self.total)


class SnapshotBucket:
    """The snapshots of every model under one ``s3://BUCKET/PREFIX``."""

    def __init__(self, url: str, max_bandwidth: int = 0, client: Any = None, credentials: dict[str, str] | None = None
                 ) -> None:
        """``credentials``: boto3's ``aws_access_key_id`` and ``aws_secret_access_key``; default: the AWS
        environment."""
        self.url = url
        self.bucket, self.prefix = parse_store_url(url)
        self.client = client if client is not None else s3_client(credentials)
        self.transfer = TransferConfig(max_bandwidth=max_bandwidth or None, use_threads=True, max_concurrency=4)

    @classmethod
    def from_config(cls, cfg: PersistentConfig) -> SnapshotBucket:
        """The bucket of ``persistent.snapshot_store``, with ``persistent.s3_*`` credentials when given."""
        assert cfg.snapshot_store is not None
        credentials = None
        if cfg.s3_access_key_id is not None and cfg.s3_secret_access_key is not None:
            credentials = {"aws_access_key_id": cfg.s3_access_key_id.get_secret_value(),
                           "aws_secret_access_key": cfg.s3_secret_access_key.get_secret_value()}
        return cls(cfg.snapshot_store, cfg.snapshot_upload_bytes_per_s, credentials=credentials)

    # ---- keys -----------------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _call(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        with s3_errors(f"{what} failed at {self.url}", f"{what}: not found in {self.url}"):
            return fn(**kwargs)

    # ---- write ----------------------------------------------------------------------------------
    def upload(self, model: str, source: Path, description: dict[str, Any],
               progress: Progress | None = None) -> dict[str, Any]:
        """Upload every file under ``source`` with its SHA-256, then the manifest (``description`` plus the file
        list); returns the manifest. Nothing is listed as a snapshot until the manifest is written."""
        snapshot_id = new_snapshot_id()
        files = uploaded_files(Path(source))  # smallest first; the manifest goes after the largest
        entries: list[dict[str, Any]] = []
        for path in files:
            entries.append({"name": path.relative_to(source).as_posix(), "size": path.stat().st_size,
                            "sha256": sha256_file(path)})
        counter = _Counter(total=sum(e["size"] for e in entries), report=progress)
        for path, entry in zip(files, entries):
            key = self._key(model, snapshot_id, "files", entry["name"])
            self._call(f"upload of {key}", self.client.upload_file, Filename=str(path), Bucket=self.bucket, Key=key,
                       ExtraArgs={"Metadata": {"sha256": entry["sha256"]}}, Config=self.transfer,
                       Callback=counter.add)
        manifest = {**description, "format": FORMAT, "id": snapshot_id, "model": model, "created_at": time.time(),
                    "files": entries, "bytes": counter.total}
        self._call(f"manifest of {snapshot_id}", self.client.put_object, Bucket=self.bucket,
                   Key=self._key(model, snapshot_id, MANIFEST), Body=json.dumps(manifest).encode(),
                   ContentType="application/json")
        return manifest

    def delete(self, model: str, snapshot_id: str) -> int:
        """Remove every object of a snapshot, its manifest first (so it stops being listed); returns how many."""
        self._check_id(snapshot_id)
        keys = self._object_keys(self._key(model, snapshot_id) + "/")
        if not keys:
            raise NotFoundError(f"no snapshot '{snapshot_id}' of model '{model}' in {self.url}")
        manifest = self._key(model, snapshot_id, MANIFEST)
        ordered = ([manifest] if manifest in keys else []) + [k for k in keys if k != manifest]
        for start in range(0, len(ordered), 1000):
            chunk = ordered[start : start + 1000]
            self._call(f"delete of {snapshot_id}", self.client.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
        return len(ordered)

    def retain(self, model: str, keep: int) -> list[str]:
        """Delete all but the newest ``keep`` complete snapshots, and unfinished uploads older than the oldest kept
        one; returns the ids deleted."""
        complete = [m["id"] for m in self.list(model)]
        doomed = complete[keep:]
        unfinished: list[str] = []
        if complete[:keep]:
            oldest_kept = complete[:keep][-1]
            unfinished = [i for i in self._snapshot_ids(model) if i not in complete and i < oldest_kept]
        for snapshot_id in doomed:
            self.delete(model, snapshot_id)
        for snapshot_id in unfinished:
            try:
                self.delete(model, snapshot_id)
            except NotFoundError:  # a prefix without objects: a store that lists deleted directories (SeaweedFS)
                continue
            doomed.append(snapshot_id)
        return doomed

    # ---- read -----------------------------------------------------------------------------------
    def list(self, model: str) -> list[dict[str, Any]]:
        """Manifests of the complete snapshots of ``model``, newest first (unreadable manifests are skipped)."""
        out = []
        for snapshot_id in sorted(self._snapshot_ids(model), reverse=True):
            try:
                out.append(self.manifest(model, snapshot_id))
            except NotFoundError:
                continue  # an upload in progress or one that died: no manifest, not a snapshot
            except CorruptSnapshotError as exc:
                log.warning("snapshot %s of %s skipped: %s", snapshot_id, model, exc)
        return out

    def manifest(self, model: str, snapshot_id: str) -> dict[str, Any]:
        """The manifest of one snapshot; NotFoundError without one, CorruptSnapshotError when unreadable."""
        self._check_id(snapshot_id)
        response = self._call(f"manifest of {snapshot_id}", self.client.get_object, Bucket=self.bucket,
                              Key=self._key(model, snapshot_id, MANIFEST))
        with response["Body"] as stream:
            if int(response.get("ContentLength") or 0) > MAX_MANIFEST_BYTES:
                body = b""
            else:
                body = stream.read(MAX_MANIFEST_BYTES + 1)
        if not body or len(body) > MAX_MANIFEST_BYTES:
            raise CorruptSnapshotError(f"manifest of {snapshot_id} is empty or larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            manifest: dict[str, Any] = json.loads(body)
            if manifest["id"] != snapshot_id or manifest["model"] != model or manifest["format"] > FORMAT:
                raise ValueError("manifest names another snapshot, model or a newer format")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptSnapshotError(f"manifest of {snapshot_id} is unreadable: {exc}") from None
        check_manifest_files(manifest)
        return manifest

    def download(self, manifest: dict[str, Any], dest: Path, progress: Progress | None = None) -> None:
        """Fetch every file of ``manifest`` into ``dest`` (which must not exist) and check sizes and SHA-256;
        CorruptSnapshotError (with ``dest`` removed) when a file is missing or differs. The manifest is checked whole
        first (names, count, sizes, free space): a refused one writes nothing, not even ``dest``."""
        dest = Path(dest)
        if dest.exists():
            raise InvalidArgumentError(f"download destination {dest} already exists")
        files = check_manifest_files(manifest)
        check_fits(manifest, dest)
        targets = [file_target(dest, entry["name"]) for entry in files]
        counter = _Counter(total=int(manifest["bytes"]), report=progress)
        model, snapshot_id = manifest["model"], manifest["id"]
        dest.mkdir(parents=True)
        try:
            with ThreadPoolExecutor(max_workers=4, thread_name_prefix="hps-download") as pool:
                for entry, target in zip(files, targets, strict=True):
                    key = self._key(model, snapshot_id, "files", entry["name"])
                    fetch_exact(self.client, self.bucket, key, target, entry["size"], counter.add, pool)
                    self._verify(snapshot_id, entry, target)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    @staticmethod
    def _verify(snapshot_id: str, entry: dict[str, Any], target: Path) -> None:
        """CorruptSnapshotError unless ``target`` has the entry's size and SHA-256."""
        size = target.stat().st_size
        if size != entry["size"]:
            raise CorruptSnapshotError(
                f"file {entry['name']} of snapshot {snapshot_id} has {size} bytes, the manifest says {entry['size']}")
        if sha256_file(target) != entry["sha256"]:
            raise CorruptSnapshotError(f"file {entry['name']} of snapshot {snapshot_id} fails its SHA-256")

    def _snapshot_ids(self, model: str) -> builtins.list[str]:  # "list" is the method above here
        """Ids of every snapshot prefix of ``model``, complete or not."""
        prefix = self._key(model) + "/"
        ids = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    name = common["Prefix"][len(prefix):].rstrip("/")
                    if SNAPSHOT_ID.match(name):
                        ids.append(name)
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(f"listing snapshots of {model} in {self.url} failed: {exc}") from None
        return ids

    def _object_keys(self, prefix: str) -> builtins.list[str]:
        keys = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                keys += [obj["Key"] for obj in page.get("Contents", [])]
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(f"listing {prefix} in {self.url} failed: {exc}") from None
        return keys

    @staticmethod
    def _check_id(snapshot_id: str) -> None:
        if not SNAPSHOT_ID.match(snapshot_id):
            raise InvalidArgumentError(f"invalid snapshot id {snapshot_id!r}")

