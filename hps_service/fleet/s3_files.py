"""Rows in object storage: an ``s3://BUCKET/KEY`` of a ``.npz``, ``.parquet`` or ``.safetensors`` file, or the
``s3://BUCKET/PREFIX`` of a HugeCTR directory (``PREFIX/key`` and ``PREFIX/emb_vector``), downloaded (streamed to
disk by boto3, never whole in memory) into a directory of the server's before they are read. The endpoint and
credentials come from the standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as the
snapshot store's do. The local name of a download is made of names checked here, never of a key as it is, so an
object's key cannot name a path outside the directory given.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.rows.sources import HUGECTR_FILES, SUFFIXES

_URL = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<key>.*))?$")
#: A file or directory name a download may take: no separator, not . or ..
FILE_NAME = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.\-]{1,200}$")
_TRANSFER = TransferConfig(use_threads=True, max_concurrency=4)


def is_s3(path: str) -> bool:
    """Whether ``path`` is an ``s3://`` URL."""
    return path.startswith("s3://")


def parse_s3(url: str) -> tuple[str, str]:
    """``s3://BUCKET/KEY`` as (bucket, key without slashes at its ends); InvalidArgumentError for anything else."""
    m = _URL.match(url)
    if m is None:
        raise InvalidArgumentError(f"{url[:200]!r} is not s3://BUCKET/KEY")
    return m["bucket"], (m["key"] or "").strip("/")


def s3_client(credentials: dict[str, str] | None = None) -> Any:
    """A boto3 S3 client from the AWS environment (path-style addressing for an endpoint it names: MinIO,
    SeaweedFS, ...); ``credentials``: ``aws_access_key_id`` and ``aws_secret_access_key`` instead."""
    custom = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(s3={"addressing_style": "path" if custom else "auto"},
                    retries={"max_attempts": 5, "mode": "standard"},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return boto3.client("s3", config=config, **(credentials or {}))


def checked_name(name: str, what: str) -> str:
    """``name`` if a local file may take it, else InvalidArgumentError naming ``what`` it was."""
    if not FILE_NAME.match(name):
        raise InvalidArgumentError(f"{what} {name[:200]!r} is not a name of letters, digits, '_', '-' and '.'")
    return name


#: The S3 error codes of an object that is not there.
MISSING = frozenset({"404", "NoSuchKey", "NotFound"})


@contextmanager
def s3_errors(failed: str, not_found: str, missing: frozenset[str] = MISSING) -> Iterator[None]:
    """boto3's errors as the domain's: NotFoundError(``not_found``) for an error code in ``missing``, else
    UnavailableError naming what ``failed`` and the store's error."""
    try:
        yield
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code", "") in missing:
            raise NotFoundError(not_found) from None
        raise UnavailableError(f"{failed}: {exc}") from None
    except BotoCoreError as exc:
        raise UnavailableError(f"{failed}: {exc}") from None


def download(client: Any, bucket: str, key: str, dest: Path) -> None:
    """Stream one object to ``dest``; NotFoundError when there is none, UnavailableError when the store fails."""
    with s3_errors(f"cannot download s3://{bucket}/{key}", f"s3://{bucket}/{key} does not exist",
                   frozenset({"404", "NoSuchKey", "NoSuchBucket"})):
        client.download_file(bucket, key, str(dest), Config=_TRANSFER)


def download_rows(url: str, dest: Path, client: Any | None = None) -> Path:
    """Download the rows at ``url`` into the directory ``dest``: the file, or a HugeCTR directory's two files;
    returns the local path to read them from."""
    bucket, key = parse_s3(url)
    client = client if client is not None else s3_client()
    name = checked_name(key.rsplit("/", 1)[-1] or bucket, "the last part of the key")
    local = dest / name
    if name.endswith(SUFFIXES):
        download(client, bucket, key, local)
        return local
    local.mkdir(parents=True, exist_ok=True)
    for part in HUGECTR_FILES:
        try:
            download(client, bucket, f"{key}/{part}", local / part)
        except NotFoundError:
            raise InvalidArgumentError(f"{url} is neither a .npz, .parquet or .safetensors object nor a HugeCTR "
                                       f"directory: there is no {url}/{part}") from None
    return local
