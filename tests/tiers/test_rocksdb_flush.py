"""A RocksDB secondary instance never answers from before a flush (issue 27, defect 1; RocksDB upstream 14444/15051,
in rocksdict 0.3.29's RocksDB 10.4.2): the tier's flush policy decides every memtable switch and writes a marker right
after it (tiers/rocksdb/flush.py), RocksDB's own flushes (a checkpoint's, an ingest's) are marked too, and the
policy keeps the memtables and the write-ahead logs within their configured bounds."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from hps_service.tiers.base import TableWrite
from hps_service.tiers.rocksdb.flush import wal_bytes, wal_numbers
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM = 4
EMPTY = np.zeros(0, np.int64)


def _put(tier: RocksDBTier, table: str, keys: np.ndarray, version: int) -> None:
    tier.write([TableWrite(table, keys, np.full((keys.shape[0], DIM), version, np.float32),
                           np.full(keys.shape[0], version, np.int64), EMPTY, None)], {("topic", 0): version})


def test_a_secondary_answers_the_newest_row_after_a_flush_of_every_memtable(tmp_path: Path) -> None:
    """The issue's steps: v1; a secondary opens; v2, caught up (v2); v3 (WAL synced), every memtable flushed (a
    checkpoint flushes every column family), caught up: RocksDB 10.4.2 answers v2 for ever after."""
    primary = RocksDBTier(tmp_path / "db", block_cache_mb=8)
    primary.create_table("m.t", DIM)
    keys = np.array([1, 2, 3], np.int64)
    _put(primary, "m.t", keys, 1)
    secondary = RocksDBTier(tmp_path / "db", block_cache_mb=8, secondary_path=tmp_path / "secondary")
    try:
        _put(primary, "m.t", keys, 2)
        secondary.catch_up()
        assert secondary.get("m.t", keys).versions.tolist() == [2, 2, 2]
        _put(primary, "m.t", keys, 3)
        primary.checkpoint(tmp_path / "checkpoint")
        for _ in range(3):
            secondary.catch_up()
            assert secondary.get("m.t", keys).versions.tolist() == [3, 3, 3]
        assert primary.get("m.t", keys).versions.tolist() == [3, 3, 3]
    finally:
        secondary.close()
        primary.close()


def test_an_ingest_over_replayed_rows_is_seen_by_a_secondary(tmp_path: Path) -> None:
    """An import's ingest flushes the memtable it overlaps; the secondary had replayed older rows of its keys."""
    primary = RocksDBTier(tmp_path / "db", block_cache_mb=8)
    primary.create_table("m.t", DIM)
    keys = np.arange(10, 20, dtype=np.int64)
    secondary = RocksDBTier(tmp_path / "db", block_cache_mb=8, secondary_path=tmp_path / "secondary")
    try:
        _put(primary, "m.t", keys, 1)
        secondary.catch_up()
        assert (secondary.get("m.t", keys).versions == 1).all()
        primary.bulk_import("m.t", keys, np.full((keys.shape[0], DIM), 5, np.float32), version=5)
        secondary.catch_up()
        got = secondary.get("m.t", keys)
        assert (got.versions == 5).all() and (got.vectors == 5).all()
    finally:
        secondary.close()
        primary.close()


def test_under_a_random_load_with_small_memtables_a_secondary_is_never_behind_after_a_catch_up(
        tmp_path: Path) -> None:
    """Four tables written at random with 64 KiB memtables and a 1 MiB log bound (the policy switches memtables
    dozens of times): after every catch-up the secondary answers each table's every key as the primary does;
    the memtables and the logs stay within their bounds, and the pin lets no log go before the policy does."""
    primary = RocksDBTier(tmp_path / "db", block_cache_mb=8, sync_writes=False, write_buffer_mb=1 / 16,
                          max_total_wal_mb=1)
    tables = ["m.a", "m.b", "m.c", "m.d"]
    for t in tables:
        primary.create_table(t, DIM)
    secondary = RocksDBTier(tmp_path / "db", block_cache_mb=8, secondary_path=tmp_path / "secondary")
    rng = random.Random(7)
    keys = np.arange(400, dtype=np.int64)
    behind = checks = 0
    most_logs = 0
    try:
        for version in range(1, 1501):
            table = tables[min(3, int(rng.expovariate(1.5)))]  # the first table most, the last rarely
            chosen = np.unique(np.array(rng.sample(range(400), 24), np.int64))
            _put(primary, table, chosen, version)
            if version % 8 == 0:
                most_logs = max(most_logs, wal_bytes(tmp_path / "db"))
            if rng.random() < 0.1:
                secondary.catch_up()
                for t in tables:
                    checks += 1
                    behind += int((secondary.get(t, keys).versions != primary.get(t, keys).versions).any())
        flushes = primary._flusher.flushes  # type: ignore[union-attr]
        assert behind == 0, f"{behind} of {checks} reads of a table were behind the primary"
        assert flushes > 20, flushes
        assert most_logs <= 3 << 20, most_logs
        for t in tables:
            assert primary.stats(t).extra["memtable_bytes"] <= 3 * (64 << 10) + (1 << 20)  # + one arena block
        assert len(wal_numbers(tmp_path / "db")) >= 1
    finally:
        secondary.close()
        primary.close()
