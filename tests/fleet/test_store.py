"""The snapshot store against a real S3 server (SeaweedFS): manifest last, checksums verified, newest N kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hps_service.errors import NotFoundError
from hps_service.fleet.bucket import CorruptSnapshotError


def _files(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "000001.sst").write_bytes(os.urandom(300_000))
    (root / "CURRENT").write_bytes(b"MANIFEST-000001\n")
    (root / "IDENTITY").write_bytes(b"")
    (root / "LOCK").write_bytes(b"")
    (root / "LOG").write_bytes(b"RocksDB's info log")
    return root


def test_upload_list_download_round_trip(bucket, tmp_path):
    src = _files(tmp_path / "src")
    seen = []
    manifest = bucket.upload("m", src, {"tables": {"t": {"dim": 4, "rows": 1}}}, lambda d, t: seen.append((d, t)))
    # smallest first, no LOCK and no info LOG
    assert [e["name"] for e in manifest["files"]] == ["IDENTITY", "CURRENT", "000001.sst"]
    assert seen[-1] == (manifest["bytes"], manifest["bytes"])
    assert [m["id"] for m in bucket.list("m")] == [manifest["id"]]
    assert bucket.list("other") == []
    bucket.download(manifest, tmp_path / "dst")
    for e in manifest["files"]:
        assert (tmp_path / "dst" / e["name"]).read_bytes() == (src / e["name"]).read_bytes()


def test_snapshot_without_manifest_is_not_listed_and_corrupt_files_are_refused(bucket, tmp_path):
    src = _files(tmp_path / "src")
    good = bucket.upload("m", src, {"tables": {}})
    partial = bucket.upload("m", src, {"tables": {}})
    bucket.client.delete_object(Bucket=bucket.bucket, Key=bucket._key("m", partial["id"], "manifest.json"))
    assert [m["id"] for m in bucket.list("m")] == [good["id"]]
    bucket.client.put_object(Bucket=bucket.bucket, Key=bucket._key("m", good["id"], "files", "000001.sst"),
                             Body=os.urandom(300_000))
    with pytest.raises(CorruptSnapshotError, match="SHA-256"):
        bucket.download(good, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    other = bucket.upload("m", src, {"tables": {}})
    bucket.client.delete_object(Bucket=bucket.bucket, Key=bucket._key("m", other["id"], "files", "CURRENT"))
    with pytest.raises(CorruptSnapshotError, match="lacks"):
        bucket.download(other, tmp_path / "dst2")


def test_retain_keeps_the_newest(bucket, tmp_path):
    src = _files(tmp_path / "src")
    ids = [bucket.upload("m", src, {"tables": {}})["id"] for _ in range(4)]
    assert sorted(bucket.retain("m", 2)) == ids[:2]
    assert [m["id"] for m in bucket.list("m")] == ids[:1:-1]
    with pytest.raises(NotFoundError):
        bucket.delete("m", ids[0])


def test_retain_again_after_it_deleted_snapshots(bucket, tmp_path):
    """As the snapshotter does after every upload: the deleted snapshots' prefixes may still be listed (SeaweedFS
    keeps their directories), which must not make the next retain, and so every later snapshot, fail."""
    src = _files(tmp_path / "src")
    ids = [bucket.upload("m", src, {"tables": {}})["id"] for _ in range(3)]
    assert bucket.retain("m", 2) == ids[:1]
    ids.append(bucket.upload("m", src, {"tables": {}})["id"])
    assert bucket.retain("m", 2) == ids[1:2]
    assert [m["id"] for m in bucket.list("m")] == ids[:1:-1]
