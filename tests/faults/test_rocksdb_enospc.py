"""RocksDB on a small real tmpfs that fills up (issue 27, defect 4): writes fail with ENOSPC, the tier says it is not
healthy (readiness) and the update consumer commits no offset past the failed write; once space is back the store
reopens itself on the next write and the stream resumes without a restart, losing no acknowledged row. Before, writes
kept failing after the space was freed, until a restart, while ``healthy()`` stayed true."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hps_service.errors import UnavailableError
from hps_service.tiers.rocksdb import recovery as rocksdb_recovery
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM = 64
VOLUME_MB = 16


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of its own (root only: mount)."""
    path = tmp_path / "volume"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME_MB}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(volume: Path, leave: int) -> Path:
    """A ballast file that leaves ``leave`` bytes free on ``volume``."""
    st = os.statvfs(volume)
    ballast = volume / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return ballast


def rows(keys: np.ndarray, version: int) -> np.ndarray:
    return np.full((keys.shape[0], DIM), version, np.float32) + (keys % 1000)[:, None].astype(np.float32)


def test_writes_resume_once_space_is_back_and_no_acknowledged_row_is_lost(
        volume: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rocksdb_recovery, "RETRY_S", 0.05)
    monkeypatch.setattr(rocksdb_recovery, "ROOM_BYTES", 1 << 20)
    tier = RocksDBTier(volume / "db", block_cache_mb=8)
    try:
        tier.create_table("m.t", DIM)
        ballast = fill(volume, 1 << 20)
        acknowledged: dict[int, int] = {}
        failed_at = None
        for version in range(1, 400):
            keys = np.arange(version * 100, version * 100 + 100, dtype=np.int64)
            try:
                tier.put("m.t", keys, rows(keys, version), np.full(100, version, np.int64))
            except UnavailableError as exc:
                failed_at, error = version, str(exc)
                break
            acknowledged.update(dict.fromkeys(keys.tolist(), version))
        assert failed_at is not None, "the volume never filled up"
        assert "No space left on device" in error
        assert not tier.healthy()
        keys = np.arange(1, 11, dtype=np.int64)
        with pytest.raises(UnavailableError, match="cannot write"):  # still full: refused, not reopened
            tier.put("m.t", keys, rows(keys, 1), np.ones(10, np.int64))
        stored = np.array(sorted(acknowledged), np.int64)
        assert (tier.get("m.t", stored).versions == [acknowledged[k] for k in stored.tolist()]).all()  # reads go on

        ballast.unlink()
        time.sleep(0.1)
        keys = np.arange(failed_at * 100, failed_at * 100 + 100, dtype=np.int64)
        tier.put("m.t", keys, rows(keys, failed_at), np.full(100, failed_at, np.int64))  # reopened, written
        assert tier.healthy()
        acknowledged.update(dict.fromkeys(keys.tolist(), failed_at))
        stored = np.array(sorted(acknowledged), np.int64)
        got = tier.get("m.t", stored)
        assert got.found.all() and (got.versions == [acknowledged[k] for k in stored.tolist()]).all()
        np.testing.assert_array_equal(got.vectors, rows(stored, 0) + got.versions[:, None].astype(np.float32))
        assert tier.count("m.t") == len(acknowledged)
    finally:
        tier.close()
    again = RocksDBTier(volume / "db", block_cache_mb=8)  # and after a restart
    try:
        assert (again.get("m.t", stored).versions == [acknowledged[k] for k in stored.tolist()]).all()
    finally:
        again.close()


def test_the_consumer_commits_nothing_past_a_failed_write_and_resumes_without_a_restart(
        volume: Path, kafka_broker, monkeypatch: pytest.MonkeyPatch) -> None:
    from hps_service.config import UpdatesConfig
    from hps_service.updates import Publisher, UpdateConsumer
    from hps_service.updates.publisher import Deliveries
    from tests.updates.conftest import make_engine, wait_until

    monkeypatch.setattr(rocksdb_recovery, "RETRY_S", 0.05)
    monkeypatch.setattr(rocksdb_recovery, "ROOM_BYTES", 1 << 20)
    model = f"e{uuid.uuid4().hex[:10]}"
    engine = make_engine(volume / "db", model, {"t": DIM}, cache_rows=1000)
    cfg = UpdatesConfig(type="kafka", brokers=kafka_broker.bootstrap, topic_prefix="hps")
    consumer = UpdateConsumer(cfg, engine, [model], "enospc", partitions=1, commit_interval_s=0.05)
    pub = Publisher(kafka_broker.bootstrap, model, partitions=1)
    try:
        consumer.start()
        assert consumer.wait_ready(30), consumer.stats()
        first = np.arange(1000, dtype=np.int64)
        pub.publish("t", first, rows(first, 1), 1)
        pub.flush(10)
        assert wait_until(lambda: consumer.stats()["committed_offsets"].get(f"hps.{model}[0]", -1) >= 1, 30)
        ballast = fill(volume, 64 << 10)
        big = np.arange(100_000, 140_000, dtype=np.int64)  # 10 MB of rows: more than is left
        sent = Deliveries()
        assert pub.publish("t", big, rows(big, 2), 2, deliveries=sent) > 1  # several messages: several offsets
        last = pub.wait(sent, 10)[0]
        assert wait_until(lambda: consumer.stats()["apply_failures"] > 0, 30), consumer.stats()
        assert not engine.healthy()["persistent"]
        committed = consumer.stats()["committed_offsets"]
        time.sleep(0.5)
        assert consumer.stats()["committed_offsets"] == committed, "an offset was committed past a failed write"
        assert engine.persistent.get(f"{model}.t", big[:10]).found.sum() == 0

        ballast.unlink()
        # every message of ``big`` committed, not only its first: a committed offset is the next one to read
        assert wait_until(lambda: consumer.stats()["committed_offsets"].get(f"hps.{model}[0]", -1) > last, 60), \
            consumer.stats()
        assert engine.healthy()["persistent"]
        got = engine.persistent.get(f"{model}.t", np.concatenate((first, big)))
        assert got.found.all() and (got.versions[:1000] == 1).all() and (got.versions[1000:] == 2).all(), (
            int((~got.found[:1000]).sum()), int((~got.found[1000:]).sum()), consumer.stats())
    finally:
        pub.close()
        consumer.stop()
        engine.close()
