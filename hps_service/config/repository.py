"""The model repository: where new versions of the models are published for every replica to pull
(:mod:`hps_service.fleet.repository`)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from hps_service.config.base import Section

_S3 = re.compile(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$")


class RepositoryConfig(Section):
    """A directory or ``s3://BUCKET/PREFIX`` laid out ``<model>/<version>/<table>.npz`` (or ``.parquet``,
    ``.safetensors``, a HugeCTR ``<table>/`` directory): every replica polls it, imports each new version of a
    loaded model and serves it beside the model once every table of it is loaded (``ready``); a label then makes
    it live (see docs/operations/rollouts.md)."""

    url: str = Field(description="a directory of this machine, or s3://BUCKET/PREFIX (endpoint and credentials from "
                                 "the standard AWS environment, AWS_ENDPOINT_URL included, as snapshots use)")
    poll_s: float = Field(10.0, ge=0.05, le=86400, description="list the repository this often; a version is "
                          "imported once a listing shows every table's file (in a directory: two listings in a row, "
                          "unchanged)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("must be a directory or s3://BUCKET/PREFIX")
        if v.startswith("s3://") and not _S3.match(v):
            raise ValueError(f"must be s3://BUCKET[/PREFIX] with a valid bucket name, got {v!r}")
        if "://" in v and not v.startswith("s3://"):
            raise ValueError(f"must be a directory or s3://BUCKET/PREFIX, got {v!r}")
        return v.rstrip("/") or "/"
