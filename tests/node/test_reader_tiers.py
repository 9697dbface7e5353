"""A worker's RocksDB secondary (CaughtUpSecondary) against a real primary: a read never misses a write noted in the
change ring before it began, whatever the background pace; while the process reads RocksDB the background catches
up at its pace (sooner when a ring fills), not on every poll, and otherwise only before a ring laps; readers that
find the same keys stale share one catch-up."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hps_service.config import PersistentConfig
from hps_service.node import reader_tiers
from hps_service.node.reader_tiers import CaughtUpSecondary
from hps_service.store.changes import ChangeRing
from hps_service.tiers.rocksdb import RocksDBTier

DIM = 4


class Owner:
    """The primary and the change ring the owner notes each write batch's keys in (after the write)."""

    def __init__(self, path: Path) -> None:
        self.db = RocksDBTier(path, block_cache_mb=8)
        self.db.create_table("t", DIM)
        self.ring = ChangeRing(np.zeros(1 << 12, np.int64), np.zeros(4, np.int64), 0)
        self.version = 0

    def write(self, keys: list[int] | np.ndarray) -> int:
        keys = np.asarray(keys, np.int64)
        self.version += 1
        self.db.put("t", keys, np.full((keys.shape[0], DIM), self.version, np.float32),
                    np.full(keys.shape[0], self.version, np.int64))
        self.ring.append(keys)
        return self.version


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[Owner]:
    o = Owner(tmp_path / "db")
    yield o
    o.db.close()


@pytest.fixture
def sec(owner: Owner, tmp_path: Path) -> Iterator[CaughtUpSecondary]:
    """A worker's secondary of the owner's primary (its background thread reads the pace settings as it runs)."""
    s = CaughtUpSecondary(PersistentConfig(path=tmp_path / "db"), lambda: {"t": owner.ring}, block_cache_mb=8)
    yield s
    s.close()


class CountedCatchUps:
    """Counts the secondary's RocksDB catch-ups (each optionally slowed down)."""

    def __init__(self, sec: CaughtUpSecondary, delay_s: float = 0.0) -> None:
        self.n = 0
        real = sec._db.catch_up

        def counted() -> None:
            self.n += 1
            time.sleep(delay_s)
            real()

        sec._db.catch_up = counted  # type: ignore[method-assign]


def test_a_read_sees_every_write_noted_before_it_though_the_background_never_ran(
        owner: Owner, sec: CaughtUpSecondary, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader_tiers, "CATCH_UP_INTERVAL_S", 3600.0)
    monkeypatch.setattr(reader_tiers, "RING_SHARE_READING", 1.0)
    monkeypatch.setattr(reader_tiers, "RING_SHARE_IDLE", 1.0)
    for _ in range(5):
        v = owner.write([1, 2, 3])
        rows = sec.get("t", np.array([2, 9], np.int64))
        assert rows.found.tolist() == [True, False]
        assert rows.versions[0] == v and rows.vectors[0].tolist() == [v] * DIM
    owner.write([7])  # a key not asked: no catch-up needed for the read of key 2
    counted = CountedCatchUps(sec)
    assert sec.get("t", np.array([2], np.int64)).versions[0] == v
    assert counted.n == 0


def test_while_it_reads_the_background_catches_up_at_its_pace_not_on_every_poll(
        owner: Owner, sec: CaughtUpSecondary, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader_tiers, "CATCH_UP_INTERVAL_S", 0.3)
    sec.get("t", np.array([1], np.int64))  # this process reads RocksDB (for READING_S from now)
    counted = CountedCatchUps(sec)
    started = time.monotonic()
    while time.monotonic() - started < 1.5:  # a write every 10 ms, as a steady ingest
        owner.write([int(time.monotonic_ns() % 1000)])
        time.sleep(0.01)
    assert 2 <= counted.n <= 1.5 / 0.3 + 2, counted.n  # polls every 20 ms would have made about 75
    deadline = time.monotonic() + 2
    while sec._caught[id(owner.ring)] != owner.ring.position() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sec._caught[id(owner.ring)] == owner.ring.position()  # caught up without a read


@pytest.mark.parametrize("reading", [True, False])
def test_a_ring_filling_up_is_caught_up_before_the_pace_says(
        owner: Owner, sec: CaughtUpSecondary, monkeypatch: pytest.MonkeyPatch, reading: bool) -> None:
    """Reading: at a quarter of the ring though the pace is an hour; not reading: only at half of it, however long
    ago the last catch-up was (no catch-ups for a worker that never reads RocksDB, but never a lapped ring)."""
    monkeypatch.setattr(reader_tiers, "CATCH_UP_INTERVAL_S", 3600.0 if reading else 0.05)
    if reading:
        sec.get("t", np.array([1], np.int64))
    counted = CountedCatchUps(sec)
    share = reader_tiers.RING_SHARE_READING if reading else reader_tiers.RING_SHARE_IDLE
    owner.write(np.arange(int(owner.ring.size * share) - 1, dtype=np.int64))
    time.sleep(0.3)
    assert counted.n == 0  # behind, but neither the pace nor the ring says so yet
    owner.write([100])
    deadline = time.monotonic() + 2
    while sec._caught[id(owner.ring)] != owner.ring.position() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sec._caught[id(owner.ring)] == owner.ring.position()
    assert counted.n == 1


def test_readers_that_find_the_same_keys_stale_share_one_catch_up(
        owner: Owner, sec: CaughtUpSecondary, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader_tiers, "CATCH_UP_INTERVAL_S", 3600.0)
    counted = CountedCatchUps(sec, delay_s=0.2)
    v = owner.write([5])
    versions: list[int] = []
    readers = [threading.Thread(target=lambda: versions.append(int(sec.get("t", np.array([5])).versions[0])))
               for _ in range(4)]
    for r in readers:
        r.start()
    for r in readers:
        r.join(10)
    assert versions == [v] * 4
    assert counted.n == 1
