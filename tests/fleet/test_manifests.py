"""Hostile snapshot manifests against a real S3 server (SeaweedFS): whoever can write the bucket cannot make a replica
write outside its download directory, fill its disk, or list a snapshot that would. Each refusal is a
CorruptSnapshotError naming the entry, and nothing is written (not even the destination directory)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hps_service.fleet.bootstrap import BootstrapProgress, bootstrap
from hps_service.fleet.bucket import MANIFEST, CorruptSnapshotError, SnapshotBucket, sha256_file
from hps_service.fleet.manifests import MAX_FILES, MAX_MANIFEST_BYTES


def _checkpoint(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "000007.sst").write_bytes(os.urandom(50_000))
    (root / "CURRENT").write_bytes(b"MANIFEST-000009\n")
    (root / "MANIFEST-000009").write_bytes(os.urandom(300))
    (root / "OPTIONS-000011").write_bytes(b"[Version]\n")
    return root


def _rewrite(bucket: SnapshotBucket, manifest: dict) -> None:
    """Put ``manifest`` in the bucket in place of the one its id names (what an attacker with write access does)."""
    bucket.client.put_object(Bucket=bucket.bucket, Key=bucket._key("m", manifest["id"], MANIFEST),
                             Body=json.dumps(manifest).encode())


def _written(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def test_names_outside_the_directory_are_refused_and_nothing_is_written(bucket, tmp_path) -> None:
    genuine = bucket.upload("m", _checkpoint(tmp_path / "src"), {"tables": {}})
    sst = next(e for e in genuine["files"] if e["name"].endswith(".sst"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "link").symlink_to(outside)  # a name that resolves through a symbolic link
    hostile = [str(outside / "x.sst"), "a/../../x", "", "../x.sst", "link/000007.sst", "sub/000007.sst",
               "000007.sst/../../x", "CURRENT\n", "x.pth", ".", "..", "LOCK", "000007.sst\x00.pth"]
    before = _written(tmp_path)
    for name in hostile:
        bad = {**genuine, "files": [*genuine["files"], {**sst, "name": name}], "bytes": genuine["bytes"] + sst["size"]}
        _rewrite(bucket, bad)
        with pytest.raises(CorruptSnapshotError, match="is not the name of a RocksDB file") as refused:
            bucket.manifest("m", genuine["id"])
        assert repr(name)[:60] in str(refused.value)
        assert bucket.list("m") == []  # never offered for a restore
        dest = tmp_path / "work" / "dest"
        with pytest.raises(CorruptSnapshotError, match="is not the name of a RocksDB file"):
            bucket.download(bad, dest)  # a manifest already in hand is checked again
        assert not dest.exists()
        assert _written(tmp_path) == before, name
    _rewrite(bucket, genuine)
    bucket.download(bucket.manifest("m", genuine["id"]), tmp_path / "work" / "ok")
    assert sorted(_written(tmp_path / "work" / "ok")) == sorted(e["name"] for e in genuine["files"])


def test_a_symlink_in_the_checkpoint_is_never_uploaded(bucket, tmp_path) -> None:
    src = _checkpoint(tmp_path / "src")
    (src / "000008.sst").symlink_to("/etc/hostname")  # would upload a file from outside the checkpoint
    with pytest.raises(CorruptSnapshotError, match="'000008.sst' is not a RocksDB file"):
        bucket.upload("m", src, {"tables": {}})
    assert bucket._object_keys(bucket._key("m") + "/") == []


def test_a_million_files_or_an_oversized_manifest_is_refused(bucket, tmp_path) -> None:
    genuine = bucket.upload("m", _checkpoint(tmp_path / "src"), {"tables": {}})
    _rewrite(bucket, {**genuine, "files": [{}] * 10**6})
    with pytest.raises(CorruptSnapshotError, match=f"lists 1000000 files, more than {MAX_FILES}"):
        bucket.manifest("m", genuine["id"])
    padded = {**genuine, "padding": "x" * MAX_MANIFEST_BYTES}
    _rewrite(bucket, padded)
    with pytest.raises(CorruptSnapshotError, match=f"larger than {MAX_MANIFEST_BYTES} bytes"):
        bucket.manifest("m", genuine["id"])
    million = {**genuine, "files": [{"name": f"{i:06d}.sst", "size": 0, "sha256": "0" * 64} for i in range(10**6)],
               "bytes": 0}
    with pytest.raises(CorruptSnapshotError, match="lists 1000000 files"):
        bucket.download(million, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_sizes_are_capped_by_the_free_space_and_by_each_entry(bucket, tmp_path) -> None:
    src = _checkpoint(tmp_path / "src")
    genuine = bucket.upload("m", src, {"tables": {}})
    huge = {**genuine, "files": [{**genuine["files"][0], "size": 2**60}, *genuine["files"][1:]]}
    huge["bytes"] = sum(e["size"] for e in huge["files"])
    with pytest.raises(CorruptSnapshotError, match="free at"):
        bucket.download(huge, tmp_path / "dest")
    lying = {**genuine, "bytes": genuine["bytes"] + 1}
    with pytest.raises(CorruptSnapshotError, match="add up to"):
        bucket.download(lying, tmp_path / "dest")
    twice = {**genuine, "files": [*genuine["files"], genuine["files"][0]]}
    twice["bytes"] = sum(e["size"] for e in twice["files"])
    with pytest.raises(CorruptSnapshotError, match="listed twice"):
        bucket.download(twice, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    # The bucket's object grows to 20 MB behind the manifest's back: no more than the entry's size is fetched.
    sst = next(e for e in genuine["files"] if e["name"].endswith(".sst"))
    bucket.client.put_object(Bucket=bucket.bucket, Key=bucket._key("m", genuine["id"], "files", sst["name"]),
                             Body=os.urandom(20 << 20))
    seen: list[tuple[int, int]] = []
    with pytest.raises(CorruptSnapshotError, match="fails its SHA-256"):
        bucket.download(genuine, tmp_path / "dest", lambda done, total: seen.append((done, total)))
    assert seen and max(done for done, _ in seen) <= genuine["bytes"]
    assert not (tmp_path / "dest").exists()


def test_bootstrap_skips_a_hostile_snapshot_for_the_genuine_one(bucket, tmp_path) -> None:
    """The automatic restore of an empty volume (the attack's target) never sees the hostile manifest."""
    from tests.fleet.test_bootstrap import _snapshot

    genuine = _snapshot(bucket, tmp_path, "m", 40, 5)
    newer = _snapshot(bucket, tmp_path, "m", 60, 8)
    target = tmp_path / "planted.pth"
    sst = next(e for e in newer["files"] if e["name"].endswith(".sst"))
    _rewrite(bucket, {**newer, "files": [*newer["files"], {**sst, "name": str(target)}],
                      "bytes": newer["bytes"] + sst["size"]})
    assert bootstrap(tmp_path / "db", bucket, ["m"], BootstrapProgress()) == {"m": genuine["id"]}
    assert not target.exists()
    assert sha256_file(tmp_path / "db" / "CURRENT")  # the genuine snapshot is in place
