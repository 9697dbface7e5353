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
from hps_service.shm.changes import ChangeRing
from hps_service.tiers.rocksdb.tier import RocksDBTier

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


class AnnouncingOwner(Owner):
    """An owner whose primary announces its file changes in a store header, as a node's owner does."""

    def __init__(self, path: Path) -> None:
        from hps_service.node.store.l3_events import L3Announcer

        self.header = np.zeros(16, np.int64)
        self.announcer = L3Announcer(self.header)
        self.db = RocksDBTier(path, block_cache_mb=8, file_events=self.announcer)
        self.db.create_table("t", DIM)
        self.ring = ChangeRing(np.zeros(1 << 12, np.int64), np.zeros(4, np.int64), 0)
        self.version = 0

    def flush_unmarked(self) -> None:
        """What RocksDB does inside a checkpoint or an ingest: every memtable flushed, no marker written yet."""
        for cf in [*self.db._cfs.values(), self.db._meta, self.db._positions]:
            cf.flush()

    def mark(self) -> None:
        self.db._flusher.mark(self.db._flusher.families())  # type: ignore[union-attr]


@pytest.fixture
def announcing(tmp_path: Path) -> Iterator[tuple[AnnouncingOwner, CaughtUpSecondary]]:
    from hps_service.node.store.l3_events import l3_events

    o = AnnouncingOwner(tmp_path / "db")
    s = CaughtUpSecondary(PersistentConfig(path=tmp_path / "db"), lambda: {"t": o.ring}, block_cache_mb=8,
                          epochs=lambda: l3_events(o.header))
    yield o, s
    s.close()
    o.db.close()


def test_a_read_waits_out_an_announced_flush_and_never_answers_from_before_it(
        announcing: tuple[AnnouncingOwner, CaughtUpSecondary], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27, defect 1 at the seam: a read that must catch up while the owner's flush is announced and its
    marker not yet written waits; a catch-up then would keep the row replayed before the flush (RocksDB 10.4)."""
    owner, sec = announcing
    monkeypatch.setattr(reader_tiers, "CATCH_UP_INTERVAL_S", 3600.0)
    owner.write([5])
    assert sec.get("t", np.array([5])).versions[0] == owner.version  # replayed into the secondary's memtable
    v = owner.write([5])
    owner.announcer.begin()
    owner.flush_unmarked()
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(int(sec.get("t", np.array([5])).versions[0])))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not got, "the read did not wait for the announced flush"
    owner.mark()
    owner.announcer.end(False)
    reader.join(10)
    assert got == [v]


def test_a_catch_up_that_overlapped_an_announced_flush_is_made_again(
        announcing: tuple[AnnouncingOwner, CaughtUpSecondary], monkeypatch: pytest.MonkeyPatch) -> None:
    owner, sec = announcing
    monkeypatch.setattr(reader_tiers, "CATCH_UP_INTERVAL_S", 3600.0)
    owner.write([6])
    assert sec.get("t", np.array([6])).versions[0] == owner.version
    v = owner.write([6])
    calls = []
    real = sec._db.catch_up

    def overlapping() -> None:  # the first catch-up runs inside a whole announced flush, before its marker
        calls.append(1)
        if len(calls) == 1:
            owner.announcer.begin()
            owner.flush_unmarked()
            real()
            owner.mark()
            owner.announcer.end(False)
        else:
            real()

    sec._db.catch_up = overlapping  # type: ignore[method-assign]
    assert sec.get("t", np.array([6])).versions[0] == v
    assert len(calls) == 2


def test_a_reopened_primary_makes_the_secondary_open_afresh(
        announcing: tuple[AnnouncingOwner, CaughtUpSecondary]) -> None:
    owner, sec = announcing
    before = sec._db
    owner.announcer.begin()
    owner.announcer.end(True)
    v = owner.write([7])
    assert sec.get("t", np.array([7])).versions[0] == v
    assert sec._db is not before
