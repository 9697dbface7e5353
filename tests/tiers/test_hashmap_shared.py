"""The hash-map tier in shared memory: another process reads it without locks while this one writes it.

Every row written is ``key * 1000 + version`` in each column, so a row mixed from two writes, or another key's row,
is visible to the reader; the reader also checks that a key's version never goes back and that keys it knows are
present are always found, while the writer overwrites them, inserts enough new keys to grow the index several
times and deletes other keys (which moves rows and shifts index entries).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hps_service.shm.region import Region
from hps_service.tiers.base import Rows
from hps_service.tiers.hashmap import seqlock as hk
from hps_service.tiers.hashmap.reader import TableArrays, TableReader
from hps_service.tiers.hashmap.stamps import stamp_halves
from hps_service.tiers.hashmap.tier import HashMapTier
from tests.helpers import REPO

TABLE = "m.t"
CAPACITY = 200_000


def _rows(keys: np.ndarray, versions: np.ndarray, dim: int) -> np.ndarray:
    return np.repeat((keys * 1000 + versions).astype(np.float32)[:, None], dim, axis=1)


def reader_main(path: str, writable: bool, n_keys: int, dim: int) -> None:
    """Child process: read the reader keys in random batches until the file ``stop`` appears (and once more
    after); print what it saw as JSON."""
    region = Region(Path(path), writable=writable)
    prefix = f"volatile/{TABLE}"
    ctrl = region.open(f"{prefix}/ctrl", (hk.CTRL_LEN,), np.int64, writable=writable)
    meta = region.open(f"{prefix}/meta", (CAPACITY, 3), np.int64, writable=writable)
    rows = region.open(f"{prefix}/rows", (CAPACITY, dim), np.float32, writable=False)
    stamps = stamp_halves(meta)[1] if writable else None
    remaps = []

    def open_index(gen: int) -> np.ndarray:
        remaps.append(gen)
        name = f"{prefix}/index.{gen}"
        return region.open(name, ((region.path / name).stat().st_size // 4,), np.int32, writable=False)

    gen = int(ctrl[hk.CTRL_INDEX_GEN])
    reader = TableReader(TableArrays(ctrl, meta, rows, stamps, open_index(gen), gen), open_index, lfu=False)
    keys = np.arange(1, n_keys + 1, dtype=np.int64)
    newest = np.zeros(n_keys + 1, dtype=np.int64)
    rng = np.random.default_rng(os.getpid())
    reader.get(keys[:8])  # compiled (or loaded from numba's cache) before the clock starts
    lane = reader.lane()
    print("ready", flush=True)
    reads = missing = torn = backwards = 0
    stop = Path(path) / "stop"
    last = False
    while not last:
        last = stop.exists()
        batch = rng.choice(keys, min(256, n_keys))
        if reads % 3 == 2:  # the compiled pass: every key, rows straight into the answer, misses listed
            answer = np.full((batch.shape[0], dim), -1.0, dtype=np.float32)
            sources, miss = np.zeros(batch.shape[0], np.uint8), np.empty(batch.shape[0], np.int64)
            ro = batch.copy()
            ro.flags.writeable = False
            hits, _ = lane(ro, answer, sources, miss)
            found = np.ones(batch.shape[0], bool)
            found[miss[: batch.shape[0] - hits]] = False
            torn += int(np.count_nonzero((sources == 2) != found))
            versions = np.where(found, answer[:, 0].astype(np.int64) - batch * 1000, 0)
            got = Rows(vectors=answer, versions=versions, found=found)
        elif reads % 3:  # a lookup's holes: rows written in place at some positions of a larger answer
            holes = np.flatnonzero(rng.random(batch.shape[0]) < 0.5)
            answer = np.full((batch.shape[0], dim), -1.0, dtype=np.float32)
            versions, found = np.empty(holes.shape[0], np.int64), np.empty(holes.shape[0], bool)
            reader.fill(batch, holes, answer, versions, found)
            untouched = np.ones(batch.shape[0], bool)
            untouched[holes] = False
            torn += int(np.count_nonzero((answer[untouched] != -1.0).any(axis=1)))  # written outside the holes
            batch = batch[holes]
            got = Rows(vectors=answer[holes], versions=versions, found=found)
        else:
            got = reader.get(batch)
        reads += 1
        missing += int(np.count_nonzero(~got.found))
        expect = (batch * 1000 + got.versions).astype(np.float32)
        torn += int(np.count_nonzero((got.vectors != expect[:, None]).any(axis=1) & got.found))
        backwards += int(np.count_nonzero(got.versions < newest[batch]))
        np.maximum.at(newest, batch, got.versions)
    print(json.dumps({"reads": reads, "missing": missing, "torn": torn, "backwards": backwards,
                      "retries": reader.retries, "remaps": len(remaps) - 1, "lane_retries": reader.lane_retries}))


def _start_reader(region: Region, n_keys: int, dim: int) -> subprocess.Popen:
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.tiers.test_hashmap_shared import reader_main;"
              f"reader_main({str(region.path)!r}, True, {n_keys}, {dim})")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
    return proc


def _finish_reader(region: Region, proc: subprocess.Popen) -> dict:
    (region.path / "stop").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["reads"] > 1
    assert seen["missing"] == 0 and seen["torn"] == 0 and seen["backwards"] == 0, seen
    return seen


def _shared_tier(path: Path, dim: int) -> tuple[Region, HashMapTier]:
    region = Region(path, writable=True)
    tier = HashMapTier(CAPACITY, allocator=region.allocator("volatile"), release=lambda n: region.remove(f"volatile/{n}"))
    tier.create_table(TABLE, dim)
    return region, tier


def test_a_reader_in_another_process_never_sees_a_torn_row(tmp_path: Path) -> None:
    """Wide rows rewritten over and over while the reader reads them all: without the sequence lock the reader
    sees rows half old, half new within a few rounds."""
    dim, n = 2048, 64
    region, tier = _shared_tier(tmp_path / "store", dim)
    keys = np.arange(1, n + 1, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, np.ones(n, np.int64), dim), np.ones(n, np.int64))
    proc = _start_reader(region, n, dim)
    rng = np.random.default_rng(1)
    for version in range(2, 200):
        hot = rng.permutation(keys)
        tier.put(TABLE, hot, _rows(hot, np.full(n, version), dim), np.full(n, version, np.int64))
        if version % 50 == 0:
            time.sleep(0.001)
    _finish_reader(region, proc)
    tier.close()


def test_a_reader_in_another_process_never_misses_a_key_while_the_index_grows_and_rows_move(tmp_path: Path) -> None:
    """The writer overwrites the reader's keys, inserts enough new ones to double the index several times and
    deletes others (rows move into the holes, index entries shift back): the reader finds every key, each at a
    version never older than one it saw, and follows the index to its new files."""
    dim, n = 16, 2000
    region, tier = _shared_tier(tmp_path / "store", dim)
    keys = np.arange(1, n + 1, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, np.ones(n, np.int64), dim), np.ones(n, np.int64))
    proc = _start_reader(region, n, dim)
    rng = np.random.default_rng(1)
    next_new = 10_000_000
    for version in range(2, 42):  # grows the index from 4096 slots to 2**17
        time.sleep(0.0005)  # update batches arrive apart, as from a consumer
        hot = rng.choice(keys, 512, replace=False)
        tier.put(TABLE, hot, _rows(hot, np.full(512, version), dim), np.full(512, version, np.int64))
        fresh = np.arange(next_new, next_new + 4000, dtype=np.int64)
        next_new += 4000
        tier.put(TABLE, fresh, _rows(fresh, np.ones(4000, np.int64), dim), np.ones(4000, np.int64))
        tier.delete(TABLE, fresh[::2])
    seen = _finish_reader(region, proc)
    assert seen["remaps"] >= 1, seen  # the index grew under the reader, which followed it without failing a lookup
    # the reader's hits were recorded for eviction without touching the writer's metadata
    assert tier.table_arrays(TABLE).reader_stamps[:n].any()
    tier.close()


def test_overlapped_reads_are_detected_and_rerun(tmp_path: Path) -> None:
    """A read whose sequence changed (or started odd) is refused by the kernel, so the caller reruns it."""
    region = Region(tmp_path / "store", writable=True)
    tier = HashMapTier(1000, allocator=region.allocator("volatile"))
    tier.create_table(TABLE, 16)
    keys = np.arange(1, 11, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, np.ones(10, np.int64), 16), np.ones(10, np.int64))
    a = tier.table_arrays(TABLE)
    out = np.empty((10, 16), np.float32)
    versions, found, row_ids = np.empty(10, np.int64), np.empty(10, bool), np.empty(10, np.int64)

    def read(gen: int) -> int:
        return int(hk.read_rows_at(a.ctrl, a.index, np.int64(gen), a.meta[:, 0], a.rows, a.meta[:, 1],
                                   stamp_halves(a.meta)[0], keys, np.arange(10), out, versions, found, row_ids))

    assert read(a.index_gen) == 10 and found.all()
    assert read(a.index_gen + 1) == hk.READ_REMAP
    hk.seq_begin(a.ctrl)
    assert read(a.index_gen) == hk.READ_OVERLAPPED
    hk.seq_end(a.ctrl)
    assert read(a.index_gen) == 10
    tier.close()


def test_the_compiled_pass_refuses_an_overlapped_read_and_an_old_index(tmp_path: Path) -> None:
    """The compiled pass, as the sequence-lock read: an odd or changed sequence, or a replaced index, is refused."""
    from hps_service.tiers.hashmap.lane import lane_kernel

    region = Region(tmp_path / "store", writable=True)
    tier = HashMapTier(1000, allocator=region.allocator("volatile"))
    tier.create_table(TABLE, 16)
    keys = np.arange(1, 11, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, np.ones(10, np.int64), 16), np.ones(10, np.int64))
    a = tier.table_arrays(TABLE)
    out, sources, miss = np.empty((10, 16), np.float32), np.empty(10, np.uint8), np.empty(10, np.int64)

    def read(gen: int) -> tuple[int, bool]:
        owner, readers = stamp_halves(a.meta)
        return lane_kernel(a.ctrl, a.ctrl, a.meta[:, 0], owner, a.rows, readers, False, True, a.index, np.int64(gen),
                           keys, out, sources, miss)

    assert read(a.index_gen) == (10, False) and (sources == 2).all()
    np.testing.assert_array_equal(out, _rows(keys, np.ones(10, np.int64), 16))
    assert read(a.index_gen + 1)[0] == hk.READ_REMAP
    hk.seq_begin(a.ctrl)
    assert read(a.index_gen)[0] == hk.READ_OVERLAPPED
    hk.seq_end(a.ctrl)
    assert tier.mark_complete(TABLE, tier.complete_token(TABLE))
    assert read(a.index_gen) == (10, True)
    tier.close()


def complete_reader_main(path: str, n_keys: int, dim: int, capacity: int) -> None:
    """Child process: the compiled pass over the reader keys until ``stop`` appears; a pass that says the table is
    complete must hold every reader key (the writer stored them all and never deletes one: a key is only missing
    after an eviction, which loses the state in the same write)."""
    region = Region(Path(path), writable=True)
    prefix = f"volatile/{TABLE}"
    ctrl = region.open(f"{prefix}/ctrl", (hk.CTRL_LEN,), np.int64)
    meta = region.open(f"{prefix}/meta", (capacity, 3), np.int64)
    rows = region.open(f"{prefix}/rows", (capacity, dim), np.float32, writable=False)

    def open_index(gen: int) -> np.ndarray:
        name = f"{prefix}/index.{gen}"
        return region.open(name, ((region.path / name).stat().st_size // 4,), np.int32, writable=False)

    gen = int(ctrl[hk.CTRL_INDEX_GEN])
    reader = TableReader(TableArrays(ctrl, meta, rows, stamp_halves(meta)[1], open_index(gen), gen), open_index,
                         lfu=False)
    lane = reader.lane()
    batch = 16  # short passes: one fits between two writes of the owner
    batches = np.arange(1, n_keys + 1, dtype=np.int64).reshape(-1, batch)
    batches.flags.writeable = False
    out, sources, miss = np.empty((batch, dim), np.float32), np.empty(batch, np.uint8), np.empty(batch, np.int64)
    print("ready", flush=True)
    seen = {"reads": 0, "complete": 0, "incomplete": 0, "complete_but_missing": 0, "torn": 0}
    stop = Path(path) / "stop"
    while not stop.exists():
        for keys in batches:
            hits, complete = lane(keys, out, sources, miss)
            seen["reads"] += 1
            seen["complete" if complete else "incomplete"] += 1
            seen["complete_but_missing"] += int(complete and hits < batch)
            held = sources == 2
            versions = out[:, 0].astype(np.int64) - keys * 1000
            seen["torn"] += int(np.count_nonzero(held & ((out != out[:, :1]).any(axis=1) | (versions < 1))))
            sources.fill(0)
    print(json.dumps(seen))


def test_a_reader_never_sees_a_complete_table_without_a_row_it_stored(tmp_path: Path) -> None:
    """The writer stores the reader's keys and marks the table complete, then overflows it with other keys (an
    eviction takes some of the reader's): a reader in another process that sees the table complete always finds
    every one of its keys, and it sees both states."""
    dim, n, capacity = 8, 608, 1000
    region = Region(tmp_path / "store", writable=True)
    tier = HashMapTier(capacity, allocator=region.allocator("volatile"), evict_fraction=0.2)
    tier.create_table(TABLE, dim)
    keys = np.arange(1, n + 1, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, np.ones(n, np.int64), dim), np.ones(n, np.int64))
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.tiers.test_hashmap_shared import "
              f"complete_reader_main; complete_reader_main({str(region.path)!r}, {n}, {dim}, {capacity})")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
    lost = 0
    next_new = 10_000_000
    for version in range(2, 802):
        token = tier.complete_token(TABLE)
        tier.put(TABLE, keys, _rows(keys, np.full(n, version), dim), np.full(n, version, np.int64))
        assert tier.mark_complete(TABLE, token)
        time.sleep(0.0002)
        fresh = np.arange(next_new, next_new + 500, dtype=np.int64)
        next_new += 500
        tier.put(TABLE, fresh, _rows(fresh, np.ones(500, np.int64), dim), np.ones(500, np.int64))  # evicts
        lost += not tier.is_complete(TABLE)
        tier.delete(TABLE, fresh)
    (region.path / "stop").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert lost == 800 and tier.stats(TABLE).extra["complete_lost"] == 800
    assert seen["complete_but_missing"] == 0 and seen["torn"] == 0, seen
    assert seen["complete"] and seen["incomplete"], seen
    tier.close()
