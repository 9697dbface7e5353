"""One object of the snapshot store into a new file, in ranged GETs of the size its manifest gives: never more bytes
than that, whatever the bucket holds now (s3transfer asks the object for the range of its last part, so an object
grown behind the manifest's back would be written whole). Parts of a large file are fetched in parallel."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from hps_service.errors import UnavailableError
from hps_service.fleet.manifests import CorruptSnapshotError

#: Bytes per ranged GET (and per read of one).
PART_BYTES, READ_BYTES = 8 << 20, 1 << 20


def fetch_exact(client: Any, bucket: str, key: str, target: Path, size: int, progress: Callable[[int], None],
                pool: ThreadPoolExecutor) -> None:
    """Write bytes ``[0, size)`` of ``key`` into ``target`` (created here: it must not exist, a link included);
    CorruptSnapshotError when the object is missing or shorter, UnavailableError when the store fails."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        parts = [(start, min(size, start + PART_BYTES) - 1) for start in range(0, size, PART_BYTES)]
        if len(parts) <= 1:
            for start, end in parts:
                _part(client, bucket, key, fd, start, end, progress)
        else:
            for done in [pool.submit(_part, client, bucket, key, fd, start, end, progress) for start, end in parts]:
                done.result()
    finally:
        os.close(fd)


def _part(client: Any, bucket: str, key: str, fd: int, start: int, end: int, progress: Callable[[int], None]) -> None:
    try:
        response = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
        offset = start
        with response["Body"] as body:  # a server that ignores the range sends more: it is left unread
            while offset <= end and (chunk := body.read(min(READ_BYTES, end + 1 - offset))):
                os.pwrite(fd, chunk, offset)
                offset += len(chunk)
                progress(len(chunk))
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NotFound"):
            raise CorruptSnapshotError(f"the snapshot lacks its file {key}") from None
        if code in ("InvalidRange", "416"):
            raise CorruptSnapshotError(f"{key} is shorter than its manifest entry") from None
        raise UnavailableError(f"download of {key} failed: {exc}") from None
    except BotoCoreError as exc:
        raise UnavailableError(f"download of {key} failed: {exc}") from None
    if offset != end + 1:
        raise CorruptSnapshotError(f"{key} is shorter than its manifest entry")
