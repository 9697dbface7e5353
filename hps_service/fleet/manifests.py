"""What a snapshot manifest may name: RocksDB's own file names, flat, in a number and a size the destination holds.

Whoever can write the snapshot bucket writes the manifests that a replica with an empty volume downloads at its next
start. So a manifest is checked whole before one byte is written: every entry is a relative name of a file RocksDB
writes into a checkpoint (``CURRENT``, ``MANIFEST-<n>``, ``OPTIONS-<n>``, ``<n>.sst``, ...; never a path, ``..``, an
absolute name or an empty one), listed once, with a size and a SHA-256; no more than ``MAX_FILES`` of them; and all
of them together fit the free space where they go. A refusal is a CorruptSnapshotError naming the entry.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from hps_service.errors import HPSError

#: Names RocksDB writes into a checkpoint (and rocksdict's options file beside them). ``LOG``, the info log, is
#: accepted from older snapshots and no longer uploaded.
ROCKSDB_FILE = re.compile(
    r"(CURRENT|IDENTITY|MANIFEST-\d{1,20}|OPTIONS-\d{1,20}|\d{1,20}\.(sst|log|blob)|LOG(\.old\.\d{1,20})?"
    r"|rocksdict-config\.json)")
#: Files of a checkpoint that a snapshot leaves out: the lock, and RocksDB's info logs.
NOT_UPLOADED = re.compile(r"LOCK|LOG(\.old\.\d{1,20})?")
#: Most files one snapshot may list (a 64 MiB SST each: over 6 TB).
MAX_FILES = 100_000
#: Largest manifest read (MAX_FILES entries take about 11 MB).
MAX_MANIFEST_BYTES = 16 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CorruptSnapshotError(HPSError):
    """A snapshot's manifest or files are unusable (a name outside its directory, too many files, missing, truncated
    or other bytes): it is never restored."""


def check_manifest_files(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The file entries of ``manifest`` if every one is acceptable (see the module); CorruptSnapshotError naming
    the first that is not."""
    snapshot = manifest.get("id", "?")
    files = manifest.get("files")
    if not isinstance(files, list):
        raise CorruptSnapshotError(f"manifest of {snapshot} has no file list")
    if len(files) > MAX_FILES:
        raise CorruptSnapshotError(f"manifest of {snapshot} lists {len(files)} files, more than {MAX_FILES}")
    seen: set[str] = set()
    total = 0
    for entry in files:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not ROCKSDB_FILE.fullmatch(name):
            raise CorruptSnapshotError(f"manifest of {snapshot}: entry {_shown(name)} is not the name of a RocksDB "
                                       f"file in the snapshot's directory")
        if name in seen:
            raise CorruptSnapshotError(f"manifest of {snapshot}: entry {name!r} is listed twice")
        seen.add(name)
        size, digest = entry.get("size"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CorruptSnapshotError(f"manifest of {snapshot}: entry {name!r} has no valid size")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise CorruptSnapshotError(f"manifest of {snapshot}: entry {name!r} has no valid sha256")
        total += size
    if manifest.get("bytes") != total:
        raise CorruptSnapshotError(f"manifest of {snapshot} says {manifest.get('bytes')!r} bytes, its files "
                                   f"add up to {total}")
    return files


def check_fits(manifest: dict[str, Any], dest: Path) -> None:
    """CorruptSnapshotError unless the snapshot's bytes fit the free space of the filesystem ``dest`` goes on."""
    where = next((p for p in (Path(dest), *Path(dest).parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free
    if manifest["bytes"] > free:
        raise CorruptSnapshotError(f"snapshot {manifest.get('id', '?')} has {manifest['bytes']} bytes, more than "
                                   f"the {free} free at {where}")


def file_target(dest: Path, name: str) -> Path:
    """Where entry ``name`` goes: ``dest / name``, checked to resolve inside ``dest`` (the name pattern already
    keeps it there; this holds whatever the pattern becomes)."""
    target = Path(dest) / name
    if target.resolve().parent != Path(dest).resolve():
        raise CorruptSnapshotError(f"entry {name!r} resolves outside {dest}")
    return target


def uploaded_files(source: Path) -> list[Path]:
    """The files of the checkpoint at ``source`` a snapshot holds: every RocksDB file in it, smallest first (the
    bulk of a snapshot, its largest SST files, goes last). Anything else there (a directory, a link, a file RocksDB
    does not write) is refused, as a download would refuse it."""
    files = []
    for path in Path(source).iterdir():
        if NOT_UPLOADED.fullmatch(path.name):
            continue
        if path.is_symlink() or not path.is_file() or not ROCKSDB_FILE.fullmatch(path.name):
            raise CorruptSnapshotError(f"checkpoint {source}: {path.name!r} is not a RocksDB file; not uploaded")
        files.append(path)
    return sorted(files, key=lambda p: (p.stat().st_size, p.name))


def _shown(name: object) -> str:
    """An entry's name for a message: quoted, and cut short (a hostile manifest's name can be anything)."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."
