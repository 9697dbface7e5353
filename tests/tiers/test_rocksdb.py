"""RocksDBTier against real RocksDB files in tmp_path: round trips, versions, reopen, import, durability."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.tiers.base import TableWrite
from hps_service.tiers.rocksdb.tier import RocksDBTier

REPO_ROOT = Path(__file__).resolve().parents[2]
_MiB = 1 << 20


@pytest.fixture
def tier(tmp_path: Path):
    t = RocksDBTier(tmp_path / "db", block_cache_mb=8)
    yield t
    t.close()


def _rows(n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.choice(np.arange(-(10**6), 10**6, dtype=np.int64), size=n, replace=False)
    return keys, rng.standard_normal((n, dim), dtype=np.float32)


def _table_options(path: Path, table: str) -> dict[str, str]:
    """The block-based table options RocksDB recorded for ``table`` in the newest OPTIONS file."""
    latest = max(path.glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1]))
    section = latest.read_text().split(f'[TableOptions/BlockBasedTable "{table}"]')[1].split("\n[")[0]
    pairs = (line.strip().split("=", 1) for line in section.splitlines() if "=" in line)
    return {k: v for k, v in pairs}


def test_put_get_round_trip_and_missing_keys(tier: RocksDBTier) -> None:
    tier.create_table("m.t", 8)
    keys, vecs = _rows(100, 8)
    written = tier.put("m.t", keys, vecs, np.arange(100, dtype=np.int64))
    assert written.all()
    asked = np.concatenate([keys[::-1], np.array([10**7, -(10**7)], dtype=np.int64)])
    rows = tier.get("m.t", asked)
    assert rows.found.tolist() == [True] * 100 + [False, False]
    np.testing.assert_array_equal(rows.vectors[:100], vecs[::-1])
    np.testing.assert_array_equal(rows.versions[:100], np.arange(100)[::-1])
    assert tier.count("m.t") == 100
    assert tier.get("m.t", np.zeros(0, dtype=np.int64)).vectors.shape == (0, 8)


def test_versions_never_go_backwards(tier: RocksDBTier) -> None:
    tier.create_table("m.t", 2)
    keys = np.array([1, 2, 3], dtype=np.int64)
    tier.put("m.t", keys, np.full((3, 2), 1.0, np.float32), np.array([5, 5, 5]))
    written = tier.put("m.t", keys, np.full((3, 2), 2.0, np.float32), np.array([4, 5, 6]))
    assert written.tolist() == [False, True, True]
    rows = tier.get("m.t", keys)
    assert rows.vectors[:, 0].tolist() == [1.0, 2.0, 2.0]
    assert rows.versions.tolist() == [5, 5, 6]
    assert tier.count("m.t") == 3


def test_delete_counts_present_keys(tier: RocksDBTier) -> None:
    tier.create_table("m.t", 4)
    keys, vecs = _rows(10, 4)
    tier.put("m.t", keys, vecs, np.zeros(10, np.int64))
    assert tier.delete("m.t", np.concatenate([keys[:3], [10**8]])) == 3
    assert not tier.get("m.t", keys[:3]).found.any()
    assert tier.get("m.t", keys[3:]).found.all()
    assert tier.count("m.t") == 7


def test_versioned_delete_leaves_tombstones_that_refuse_older_puts(tmp_path: Path) -> None:
    tier = RocksDBTier(tmp_path / "db", block_cache_mb=8)
    tier.create_table("m.t", 2)  # dim 2: a row is 16 bytes, a tombstone 8
    keys = np.arange(1, 101, dtype=np.int64)
    vecs = np.full((100, 2), 1.0, np.float32)
    tier.put("m.t", keys, vecs, np.full(100, 5))
    assert tier.delete("m.t", keys[:50], np.full(50, 4)) == 0  # lagging delete: newer rows stay
    assert tier.get("m.t", keys).found.all()
    assert tier.delete("m.t", keys[:50], np.full(50, 5)) == 50
    absent = np.array([-7, 10**9], dtype=np.int64)
    assert tier.delete("m.t", absent, 8) == 0
    assert tier.count("m.t") == 50 and tier.tombstones("m.t") == 52
    assert not tier.get("m.t", np.concatenate([keys[:50], absent])).found.any()
    assert not tier.put("m.t", keys[:50], vecs[:50] + 1, np.full(50, 5)).any()
    assert not tier.put("m.t", keys[:50], vecs[:50] + 1, np.full(50, 3)).any()
    assert tier.delete("m.t", keys[:10], np.full(10, 2)) == 0  # a lower delete never lowers a tombstone
    assert tier.scan_keys("m.t", 1000).tolist() == keys[50:].tolist()
    tier.close()

    tier = RocksDBTier(tmp_path / "db", block_cache_mb=8)  # tombstones and both counts survive a reopen
    try:
        assert tier.count("m.t") == 50 and tier.tombstones("m.t") == 52
        assert tier.stats("m.t").extra["tombstones"] == 52
        assert not tier.put("m.t", keys[:10], vecs[:10] + 1, np.full(10, 5)).any()
        newer = tier.put("m.t", keys[:50], vecs[:50] + 2, np.full(50, 6))
        assert newer.all() and tier.get("m.t", keys[:50]).vectors[:, 0].tolist() == [3.0] * 50
        assert tier.count("m.t") == 100 and tier.tombstones("m.t") == 2
        assert tier.delete("m.t", absent) == 0  # an admin delete forgets tombstones too
        assert tier.tombstones("m.t") == 0
        assert tier.put("m.t", absent, np.zeros((2, 2), np.float32), np.zeros(2, np.int64)).all()
    finally:
        tier.close()


def test_bulk_import_respects_tombstones(tier: RocksDBTier) -> None:
    tier.create_table("m.t", 4)
    tier.delete("m.t", np.array([1, 2, 3]), np.array([3, 5, 9]))
    written = tier.bulk_import("m.t", np.array([1, 2, 3, 4]), np.ones((4, 4), np.float32), version=5)
    assert written == 2  # key 1 (tombstone at 3) and key 4; keys 2 and 3 stay deleted
    assert tier.get("m.t", np.array([1, 2, 3, 4])).found.tolist() == [True, False, False, True]
    assert tier.count("m.t") == 2 and tier.tombstones("m.t") == 2


def test_purge_tombstones_below_a_version(tier: RocksDBTier, monkeypatch) -> None:
    monkeypatch.setattr("hps_service.tiers.rocksdb.staging.SCAN_CHUNK", 7)  # several scan steps
    tier.create_table("m.t", 2)
    keys = np.arange(40, dtype=np.int64)
    tier.put("m.t", keys, np.ones((40, 2), np.float32), np.zeros(40, np.int64))
    tier.delete("m.t", keys[:30], np.repeat([10, 20, 30], 10))
    assert tier.purge_tombstones("m.t", 20) == 10
    assert tier.tombstones("m.t") == 20 and tier.count("m.t") == 10
    assert tier.put("m.t", keys[:30], np.zeros((30, 2), np.float32), np.full(30, 1)).tolist() == (
        [True] * 10 + [False] * 20
    )
    assert tier.scan_keys("m.t", 15).tolist() == keys[:10].tolist() + keys[30:35].tolist()
    assert tier.purge_tombstones("m.t", 31) == 20 and tier.tombstones("m.t") == 0


def test_unknown_table_and_bad_shapes(tier: RocksDBTier) -> None:
    with pytest.raises(NotFoundError, match="nope"):
        tier.get("m.nope", np.array([1]))
    tier.create_table("m.t", 4)
    with pytest.raises(InvalidArgumentError, match="dim 4"):
        tier.create_table("m.t", 8)
    with pytest.raises(InvalidArgumentError, match="shape"):
        tier.put("m.t", np.array([1, 2]), np.zeros((2, 3), np.float32), np.zeros(2, np.int64))
    with pytest.raises(InvalidArgumentError, match="versions"):
        tier.put("m.t", np.array([1, 2]), np.zeros((2, 4), np.float32), np.zeros(3, np.int64))
    with pytest.raises(InvalidArgumentError, match="1-D"):
        tier.get("m.t", np.zeros((2, 2), np.int64))
    with pytest.raises(InvalidArgumentError, match="delete versions must have shape"):
        tier.delete("m.t", np.array([1, 2]), np.zeros(3, np.int64))


def test_two_tables_with_different_dims(tier: RocksDBTier) -> None:
    tier.create_table("m.a", 4)
    tier.create_table("m.b", 16)
    keys = np.array([1, 2], dtype=np.int64)
    tier.put("m.a", keys, np.ones((2, 4), np.float32), np.zeros(2, np.int64))
    tier.put("m.b", keys[:1], np.full((1, 16), 3.0, np.float32), np.zeros(1, np.int64))
    assert tier.get("m.a", keys).vectors.shape == (2, 4)
    b = tier.get("m.b", keys)
    assert b.found.tolist() == [True, False] and b.vectors[0, 0] == 3.0
    assert tier.tables() == {"m.a": 4, "m.b": 16}


def test_reopen_keeps_rows_dims_and_options(tmp_path: Path) -> None:
    path = tmp_path / "db"
    t = RocksDBTier(path, block_cache_mb=8)
    t.create_table("m.a", 4)
    keys, vecs = _rows(50, 4)
    t.put("m.a", keys, vecs, np.ones(50, np.int64))
    t.bulk_import("m.a", keys[:10] + 10**7, vecs[:10])
    t.close()
    (path / "import-interrupted").mkdir()  # what a crash mid-import leaves behind
    t = RocksDBTier(path, block_cache_mb=8)
    try:
        assert t.tables() == {"m.a": 4}
        assert not (path / "import-interrupted").exists()
        assert t.count("m.a") == 60
        np.testing.assert_array_equal(t.get("m.a", keys).vectors, vecs)
        with pytest.raises(InvalidArgumentError):
            t.create_table("m.a", 8)
        table_options = _table_options(path, "m.a")
        assert table_options["filter_policy"] == "bloomfilter"
        assert table_options["data_block_index_type"] == "kDataBlockBinaryAndHash"
        assert table_options["cache_index_and_filter_blocks"] == "true"
    finally:
        t.close()


def test_read_only_mode(tmp_path: Path) -> None:
    path = tmp_path / "db"
    with pytest.raises(UnavailableError, match="no RocksDB store"):
        RocksDBTier(path, read_only=True)
    writer = RocksDBTier(path)
    writer.create_table("m.a", 2)
    writer.put("m.a", np.array([7]), np.ones((1, 2), np.float32), np.zeros(1, np.int64))
    writer.close()
    ro = RocksDBTier(path, read_only=True)
    try:
        assert ro.get("m.a", np.array([7])).found.all()
        ro.create_table("m.a", 2)
        for call in (
            lambda: ro.put("m.a", np.array([8]), np.ones((1, 2), np.float32), np.zeros(1, np.int64)),
            lambda: ro.delete("m.a", np.array([7])),
            lambda: ro.bulk_import("m.a", np.array([8]), np.ones((1, 2), np.float32)),
            lambda: ro.create_table("m.new", 2),
        ):
            with pytest.raises(UnavailableError, match="read-only"):
                call()
        assert ro.get("m.a", np.array([7, 8])).found.tolist() == [True, False]
    finally:
        ro.close()


def test_bulk_import_duplicates_last_wins_and_progress(tier: RocksDBTier, monkeypatch) -> None:
    monkeypatch.setattr("hps_service.tiers.rocksdb.files.IMPORT_CHUNK_ROWS", 100)
    tier.create_table("m.t", 4)
    keys, vecs = _rows(350, 4)
    keys[-5:] = keys[:5]  # five duplicates: later rows must win
    keys[10] = -1  # negative keys sort after positives in unsigned byte order; must still work
    seen: list[int] = []
    written = tier.bulk_import("m.t", keys, vecs, version=3, progress=seen.append)
    assert written == 345
    assert seen == [100, 200, 300, 345]
    rows = tier.get("m.t", keys[:-5])
    assert rows.found.all() and (rows.versions == 3).all()
    np.testing.assert_array_equal(rows.vectors[:5], vecs[-5:])
    np.testing.assert_array_equal(rows.vectors[5:], vecs[5:-5])
    assert tier.count("m.t") == 345
    # RocksDB's estimate counts the delete the import's flush wrote as a marker (tiers/rocksdb/flush.py) against it
    assert 344 <= tier.stats("m.t").extra["estimate_num_keys"] <= 345


def test_bulk_import_into_filled_table_keeps_newer_rows(tier: RocksDBTier) -> None:
    tier.create_table("m.t", 2)
    tier.put("m.t", np.array([1, 2]), np.full((2, 2), 9.0, np.float32), np.array([10, 1]))
    written = tier.bulk_import("m.t", np.array([1, 2, 3]), np.zeros((3, 2), np.float32), version=5)
    assert written == 2
    rows = tier.get("m.t", np.array([1, 2, 3]))
    assert rows.vectors[:, 0].tolist() == [9.0, 0.0, 0.0]
    assert rows.versions.tolist() == [10, 5, 5]
    assert tier.count("m.t") == 3


def test_bulk_import_is_atomic(tier: RocksDBTier, monkeypatch) -> None:
    monkeypatch.setattr("hps_service.tiers.rocksdb.files.IMPORT_CHUNK_ROWS", 10)
    tier.create_table("m.t", 4)
    keys = np.arange(100, dtype=np.int64)
    vecs = np.ones((100, 4), np.float32)
    from hps_service.tiers.rocksdb import files

    encode_keys, calls = files.encode_keys, []

    def fail_in_the_last_chunk(chunk: np.ndarray) -> list[bytes]:  # earlier chunks are already written to disk
        calls.append(1)
        if len(calls) == 10:
            raise InvalidArgumentError("row 95 cannot be written")
        return encode_keys(chunk)

    monkeypatch.setattr(files, "encode_keys", fail_in_the_last_chunk)
    with pytest.raises(InvalidArgumentError, match="row 95"):
        tier.bulk_import("m.t", keys, vecs)
    monkeypatch.setattr(files, "encode_keys", encode_keys)
    assert not tier.get("m.t", keys).found.any()
    assert tier.count("m.t") == 0
    assert not list(tier.path.glob("import-*"))


def test_checkpoint_round_trip(tier: RocksDBTier, tmp_path: Path) -> None:
    tier.create_table("m.t", 4)
    keys, vecs = _rows(20, 4)
    tier.put("m.t", keys, vecs, np.zeros(20, np.int64))
    snap = tmp_path / "snap"
    tier.checkpoint(snap)
    tier.put("m.t", keys[:5], vecs[:5] + 1, np.ones(5, np.int64))
    with pytest.raises(InvalidArgumentError, match="exists"):
        tier.checkpoint(snap)
    restored = RocksDBTier(snap, read_only=True)
    try:
        np.testing.assert_array_equal(restored.get("m.t", keys).vectors, vecs)
        assert restored.count("m.t") == 20
    finally:
        restored.close()


def test_scan_keys_in_store_order(tier: RocksDBTier) -> None:
    tier.create_table("m.t", 2)
    keys = np.array([30, -5, 7, 1, 100], dtype=np.int64)
    tier.put("m.t", keys, np.zeros((5, 2), np.float32), np.zeros(5, np.int64))
    assert tier.scan_keys("m.t", 3).tolist() == [1, 7, 30]
    assert tier.scan_keys("m.t", 10).tolist() == [1, 7, 30, 100, -5]
    assert tier.scan_keys("m.t", 0).size == 0


def test_drop_table_and_close(tmp_path: Path) -> None:
    t = RocksDBTier(tmp_path / "db")
    t.create_table("m.t", 2)
    t.put("m.t", np.array([1]), np.zeros((1, 2), np.float32), np.zeros(1, np.int64))
    t.drop_table("m.t")
    with pytest.raises(NotFoundError):
        t.count("m.t")
    t.create_table("m.t", 3)
    assert t.count("m.t") == 0 and not t.get("m.t", np.array([1])).found.any()
    assert t.healthy()
    t.close()
    assert not t.healthy()
    with pytest.raises(UnavailableError, match="closed"):
        t.get("m.t", np.array([1]))


_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from hps_service.tiers.rocksdb.tier import RocksDBTier

    tier = RocksDBTier(sys.argv[1], block_cache_mb=8, sync_writes=True)
    tier.create_table("m.t", 4)
    batch = 0
    while True:
        keys = np.arange(batch * 64, (batch + 1) * 64, dtype=np.int64)
        tier.put("m.t", keys, np.full((64, 4), batch, np.float32), np.full(64, batch, np.int64))
        print(batch, flush=True)
        batch += 1
    """
)


def test_synced_puts_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "db"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        acked = -1
        for line in proc.stdout:
            acked = int(line)
            if acked >= 20:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert acked >= 20
    tier = RocksDBTier(path, block_cache_mb=8)
    try:
        keys = np.arange((acked + 1) * 64, dtype=np.int64)
        rows = tier.get("m.t", keys)
        assert rows.found.all()
        np.testing.assert_array_equal(rows.versions, keys // 64)
        assert tier.count("m.t") >= (acked + 1) * 64
    finally:
        tier.close()


def _write_with_positions(tier: RocksDBTier, mib: int, dim: int = 256, batch: int = 2048) -> None:
    """``mib`` MiB of rows of 2048 keys overwritten again and again, each batch with the positions (as the update
    consumer writes them)."""
    keys = np.arange(batch, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    for i in range(mib * _MiB // (batch * dim * 4)):
        rows = np.full((batch, dim), i, dtype=np.float32)
        tier.write([TableWrite("m.t", keys, rows, np.full(batch, i + 1, np.int64), empty, None)],
                   positions={("topic", 0): i + 1})


def _log_bytes(path: Path) -> int:
    """Bytes of the write-ahead logs in ``path``; a log RocksDB's background work deletes meanwhile is not kept."""
    total = 0
    for log in path.glob("*.log"):
        try:
            total += log.stat().st_size
        except FileNotFoundError:
            pass
    return total


def test_the_write_ahead_logs_stay_bounded_though_the_positions_never_fill_a_memtable(tmp_path: Path) -> None:
    """The positions are written with every batch yet never fill a memtable. A log is kept until every column
    family with data in it flushed, so without ``max_total_wal_mb`` every log since the start is kept (a restart
    replays them all, a secondary instance holds one memtable of positions per log)."""
    bounded = RocksDBTier(tmp_path / "bounded", block_cache_mb=8, max_total_wal_mb=8)
    bounded.create_table("m.t", 256)
    _write_with_positions(bounded, 96)
    secondary = RocksDBTier(tmp_path / "bounded", secondary_path=tmp_path / "secondary", block_cache_mb=8)
    assert _log_bytes(tmp_path / "bounded") <= 24 * _MiB
    assert secondary.memory_bytes()["memtables"] <= 24 * _MiB
    assert bounded.get("m.t", np.arange(2048, dtype=np.int64)).versions.min() == 96 * _MiB // (2048 * 256 * 4)
    assert bounded.positions() == {("topic", 0): 96 * _MiB // (2048 * 256 * 4)}
    secondary.close()
    bounded.close()
    unbounded = RocksDBTier(tmp_path / "unbounded", block_cache_mb=8, max_total_wal_mb=1024)
    unbounded.create_table("m.t", 256)
    _write_with_positions(unbounded, 96)
    assert _log_bytes(tmp_path / "unbounded") >= 90 * _MiB  # what the bound prevents
    unbounded.close()


def test_a_secondary_opens_while_the_primary_drops_and_creates_column_families(tmp_path: Path) -> None:
    """A secondary lists the primary's column families, then opens them: one dropped in between (a version
    dropped, a conversion's old rows freed) is listed afresh, never an open that fails with 'Column family not
    found'."""
    import threading

    primary = RocksDBTier(tmp_path / "db", block_cache_mb=8)
    stop = threading.Event()

    def churn() -> None:
        n = 0
        while not stop.is_set():
            primary.create_table(f"m.t@{n}", 4)
            if n:
                primary.drop_table(f"m.t@{n - 1}")
            n += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for i in range(40):
            RocksDBTier(tmp_path / "db", block_cache_mb=8, secondary_path=tmp_path / f"s{i}").close()
    finally:
        stop.set()
        thread.join()
        primary.close()
