"""Fixtures of the fleet tests: a snapshot bucket of its own per test on the session's SeaweedFS."""

from __future__ import annotations

import pytest

from hps_service.fleet.bucket import SnapshotBucket


@pytest.fixture
def bucket(s3_server, monkeypatch) -> SnapshotBucket:
    """A fresh bucket, reached through the standard AWS environment as a server would."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return SnapshotBucket(f"s3://{s3_server.new_bucket()}/fleet")
