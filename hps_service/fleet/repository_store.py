"""What a model repository holds, listed from a directory or an ``s3://BUCKET/PREFIX``, and its files fetched.

The layout is ``<model>/<version>/<table>.npz`` (or ``.parquet``, ``.safetensors``, or a HugeCTR ``<table>/``
directory of ``key`` and ``emb_vector``). A listing keeps only what fits it: a model and a table are names of the
config's pattern, a version a decimal number from 1 (``7``, not ``07``); any other entry is counted as ignored, never
read. A file is fetched (S3) or read (a directory) under a local name made of those checked names, and a directory
entry that resolves outside the repository (a symbolic link out of it) is ignored, so nothing a repository holds can
name a path outside the server's directories.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from botocore.exceptions import BotoCoreError, ClientError

from hps_service.config.base import NAME_RE
from hps_service.errors import UnavailableError
from hps_service.fleet.s3_files import download, parse_s3, s3_client
from hps_service.rows.sources import HUGECTR_FILES, SUFFIXES

_VERSION = re.compile(r"^[1-9][0-9]{0,9}$")
MAX_VERSION = 2**31 - 1


@dataclass(frozen=True)
class TableFile:
    """One table's rows in a version: a file (``kind`` its suffix) or a HugeCTR directory (``kind`` "hugectr"), and
    each of its parts' (size, stamp): a directory's modification time, an object's ETag."""

    table: str
    kind: str
    parts: tuple[tuple[str, int, str], ...]

    @property
    def complete(self) -> bool:
        """Whether every part of it is there (a HugeCTR directory needs its two files)."""
        return self.kind != "hugectr" or {p[0] for p in self.parts} == set(HUGECTR_FILES)


@dataclass
class VersionListing:
    """The files of one version in the repository: per table its rows, what else is there, and a signature of it
    all that changes with any file."""

    model: str
    version: int
    tables: dict[str, list[TableFile]] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)

    @property
    def signature(self) -> str:
        parts = sorted((t.table, t.kind, p) for files in self.tables.values() for t in files for p in t.parts)
        return hashlib.sha256(repr((parts, sorted(self.others))).encode()).hexdigest()[:16]


#: model -> version -> its listing
Listing = dict[str, dict[int, VersionListing]]


def _version(name: str) -> int | None:
    return int(name) if _VERSION.match(name) and int(name) <= MAX_VERSION else None


class Repository(Protocol):
    """A model repository: its URL, a listing of it, and a table's rows fetched to read."""

    url: str
    #: Whether a listed file is whole (an object store's), or may still be being written (a directory's).
    atomic: bool

    def list(self) -> tuple[Listing, int]:
        """Every version of every model it holds, and how many entries were ignored (not of the layout)."""
        ...

    def fetch(self, listing: VersionListing, table: TableFile, dest: Path) -> Path:
        """The local path to read ``table`` of ``listing`` from: fetched into the directory ``dest`` if need be."""
        ...


@dataclass
class _Collect:
    listing: Listing = field(default_factory=dict)
    ignored: int = 0

    def add(self, model: str, version_name: str, rest: list[str], size: int, stamp: str) -> None:
        """One file at ``<model>/<version>/<rest...>``."""
        version = _version(version_name)
        if not NAME_RE.match(model) or version is None or not rest:
            self.ignored += 1
            return
        entry = self.listing.setdefault(model, {}).setdefault(version, VersionListing(model, version))
        name = rest[0]
        stem, dot, suffix = name.rpartition(".")
        if len(rest) == 1 and dot and f".{suffix}" in SUFFIXES and NAME_RE.match(stem):
            entry.tables.setdefault(stem, []).append(TableFile(stem, f".{suffix}", ((name, size, stamp),)))
        elif len(rest) == 2 and NAME_RE.match(name) and rest[1] in HUGECTR_FILES:
            files = entry.tables.setdefault(name, [])
            hugectr = next((f for f in files if f.kind == "hugectr"), None)
            if hugectr is not None:
                files.remove(hugectr)
            parts = (*(hugectr.parts if hugectr is not None else ()), (rest[1], size, stamp))
            files.append(TableFile(name, "hugectr", tuple(sorted(parts))))
        else:
            entry.others.append("/".join(rest))


class LocalRepository:
    """A repository in a directory of this machine."""

    atomic = False

    def __init__(self, root: str) -> None:
        self.url = root
        self.root = Path(root).resolve()

    def _inside(self, path: Path) -> bool:
        return path.resolve().is_relative_to(self.root)

    def _walk(self, path: Path, depth: int) -> Iterator[tuple[list[str], os.stat_result]]:
        """(relative parts, stat) of the files up to ``depth`` levels below ``path`` (links out of the root
        skipped)."""
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            child = Path(entry.path)
            if not self._inside(child):
                continue
            if entry.is_dir():
                if depth > 1:
                    for rest, st in self._walk(child, depth - 1):
                        yield [entry.name, *rest], st
            elif entry.is_file():
                yield [entry.name], entry.stat()

    def list(self) -> tuple[Listing, int]:
        if not self.root.is_dir():
            raise UnavailableError(f"the model repository {self.url} is not a directory")
        found = _Collect()
        for parts, st in self._walk(self.root, 4):
            if len(parts) < 3:
                found.ignored += 1
                continue
            found.add(parts[0], parts[1], parts[2:], st.st_size, str(st.st_mtime_ns))
        return found.listing, found.ignored

    def fetch(self, listing: VersionListing, table: TableFile, dest: Path) -> Path:
        base = self.root / listing.model / str(listing.version)
        return base / table.table if table.kind == "hugectr" else base / table.parts[0][0]


class S3Repository:
    """A repository under ``s3://BUCKET/PREFIX``, listed with ListObjectsV2 and fetched with boto3's downloads."""

    atomic = True

    def __init__(self, url: str, client: Any | None = None) -> None:
        self.url = url
        self.bucket, self.prefix = parse_s3(url)
        self.client = client if client is not None else s3_client()

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def list(self) -> tuple[Listing, int]:
        found = _Collect()
        start = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                for obj in page.get("Contents", []):
                    parts = obj["Key"][len(start):].split("/")
                    if len(parts) < 3 or len(parts) > 4:
                        found.ignored += 1
                        continue
                    found.add(parts[0], parts[1], parts[2:], int(obj["Size"]), str(obj.get("ETag", "")))
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(f"cannot list the model repository {self.url}: {exc}") from None
        return found.listing, found.ignored

    def fetch(self, listing: VersionListing, table: TableFile, dest: Path) -> Path:
        where = self._key(listing.model, str(listing.version))
        if table.kind == "hugectr":
            local = dest / table.table
            local.mkdir(parents=True, exist_ok=True)
            for part in HUGECTR_FILES:
                download(self.client, self.bucket, f"{where}/{table.table}/{part}", local / part)
            return local
        local = dest / f"{table.table}{table.kind}"
        download(self.client, self.bucket, f"{where}/{table.parts[0][0]}", local)
        return local


def open_repository(url: str) -> Repository:
    """The repository at ``url``: ``s3://BUCKET/PREFIX`` or a directory."""
    return S3Repository(url) if url.startswith("s3://") else LocalRepository(url)
