"""The store's small parts on real shared files: the worker-to-owner queue, the RocksDB change ring, counters
many threads add to, the file permissions, and how many CPUs a process may use."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hps_service.errors import UnavailableError
from hps_service.node.store import layout
from hps_service.node.store.node_store import NodeStore
from hps_service.node.store.view import StoreView
from hps_service.runtime.cpus import affinity_cpus, cgroup_cpu_limit, usable_cpus
from hps_service.shm.changes import ChangeRing
from hps_service.shm.counters import REQ_FIELDS, STATUS_INDEX, RequestCounters, new_counters, request_totals
from hps_service.shm.permissions import PRIVATE, StoreAccess
from hps_service.shm.queue import CTRL_LEN, Ring, record_bytes
from hps_service.shm.region import Region

#: The interpreter a probe runs under as another user (the project's virtualenv may be private to its owner).
SYSTEM_PYTHON = "/usr/bin/python3"
#: The colocated readers' group (server.local.group): one of no user here when root may give files to it.
READERS_GID = 23456 if os.geteuid() == 0 else os.getgid()


def _ring(tmp_path: Path, size: int = 4096) -> Ring:
    region = Region(tmp_path / "q", writable=True)
    return Ring(region.create("ctrl", (CTRL_LEN,), np.int64), region.create("data", (size,), np.uint8))


def test_queue_round_trip_wraps_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    ring = _ring(tmp_path)
    rng = np.random.default_rng(0)
    sent = []
    for i in range(40):  # many times the ring's size in all: records wrap around its end
        n = int(rng.integers(1, 6))
        keys, versions = rng.integers(-2**63, 2**63 - 1, n), rng.integers(0, 10, n)
        rows = rng.standard_normal((n, 3 if i % 4 == 1 else 8)).astype(np.float32)  # an odd width pads its record
        assert ring.push(1 + i % 2, i, 100 + i, 0.25, keys, versions, rows)
        sent.append((1 + i % 2, i, 100 + i, keys, versions, rows))
        if i % 3 == 2:
            got = ring.pop_all()
            want, sent = sent[: len(got)], sent[len(got):]
            assert len(got) == len(want) > 0
            for rec, (kind, table, gen, keys_, versions_, rows_) in zip(got, want):
                assert (rec.kind, rec.table, rec.generation, rec.hit_rate) == (kind, table, gen, 0.25)
                np.testing.assert_array_equal(rec.keys, keys_)
                np.testing.assert_array_equal(rec.versions, versions_)
                np.testing.assert_array_equal(rec.rows, rows_)
    assert len(ring.pop_all()) == len(sent)
    ring = _ring(tmp_path / "full")  # from position 0: as many of these as the ring holds, then a refusal
    big = record_bytes(40, 8)
    n_fit = 4096 // big
    assert all(ring.push(1, 0, 0, 0.0, np.zeros(40, np.int64), np.zeros(40, np.int64), np.zeros((40, 8), np.float32))
               for _ in range(n_fit))
    assert not ring.push(1, 0, 0, 0.0, np.zeros(40, np.int64), np.zeros(40, np.int64), np.zeros((40, 8), np.float32))
    assert len(ring.pop_all()) == n_fit and ring.empty()


def test_a_record_after_the_last_8_bytes_of_the_ring_starts_at_0(tmp_path: Path) -> None:
    """Records that end 8 bytes before the ring's end leave room for a padding length and nothing else."""
    ring = _ring(tmp_path)
    one = (np.array([7], np.int64), np.array([1], np.int64))
    sizes = [record_bytes(1, 2)] * 45 + [record_bytes(1, 12)]
    assert sum(sizes) == ring.size - 8
    for i, size in enumerate(sizes):
        assert ring.push(1, i, 0, 0.0, *one, np.zeros((1, 2 if size == sizes[0] else 12), np.float32))
    assert len(ring.pop_all()) == len(sizes)
    rows = np.arange(6, dtype=np.float32).reshape(1, 6)
    assert ring.push(2, 99, 5, 0.5, *one, rows)
    (rec,) = ring.pop_all()
    assert (rec.kind, rec.table, rec.generation, rec.hit_rate) == (2, 99, 5, 0.5)
    np.testing.assert_array_equal(rec.rows, rows)
    assert ring.empty()


def test_change_ring_names_the_keys_written_since_a_position(tmp_path: Path) -> None:
    region = Region(tmp_path / "c", writable=True)
    ring = ChangeRing(region.create("keys", (16,), np.int64), region.create("ctrl", (24,), np.int64), 16)
    since = ring.position()
    assert not ring.stale(since, np.array([1, 2, 3]))
    ring.append(np.array([5, 6]))
    assert ring.stale(since, np.array([1, 6])) and not ring.stale(since, np.array([1, 2]))
    assert not ring.stale(ring.position(), np.array([5, 6]))
    since = ring.position()
    ring.append(np.arange(100, 114))  # wraps around the end of the ring
    assert ring.stale(since, np.array([113])) and not ring.stale(since, np.array([5]))
    ring.append(np.arange(200, 210))  # more than the ring holds since ``since``: everything may be stale
    assert ring.stale(since, np.array([-1]))
    since = ring.position()
    ring.append(None)  # an import: keys unknown
    assert ring.stale(since, np.array([-1]))


def test_counters_of_many_threads_and_processes_add_up(tmp_path: Path) -> None:
    array = new_counters(3, REQ_FIELDS)
    procs = [RequestCounters(array, p) for p in range(3)]
    calls = 2000

    def count(counters: RequestCounters) -> None:
        for i in range(calls):
            row = counters.begin()
            counters.observe_keys(1024)
            counters.finish(row, 0, STATUS_INDEX["OK"] if i % 4 else STATUS_INDEX["NOT_FOUND"], 0.0004)

    threads = [threading.Thread(target=count, args=(procs[i % 3],)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    totals = request_totals(procs[0].totals())
    assert totals["requests"] == {("Lookup", "OK"): 6 * calls * 3 / 4, ("Lookup", "NOT_FOUND"): 6 * calls / 4}
    assert totals["in_flight"] == 0
    cumulative, latency_sum = totals["latency"]["Lookup"]
    assert cumulative[-1] == 6 * calls and latency_sum == pytest.approx(6 * calls * 0.0004)
    keys_cumulative, keys_sum = totals["keys"]
    assert keys_cumulative[-1] == 6 * calls and keys_sum == 6 * calls * 1024


def _modes(root: Path) -> dict[str, tuple[int, int]]:
    """(permission bits, gid) of every file and directory under ``root`` (links left out), ``root`` included."""
    paths = [root, *(p for p in root.rglob("*") if not p.is_symlink())]
    return {p.relative_to(root).as_posix(): (stat.S_IMODE(p.stat().st_mode), p.stat().st_gid) for p in paths}


@pytest.fixture
def usual_umask() -> Iterator[None]:
    """The usual umask (022), under which a directory made without explicit bits is 0755."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_store_files_and_every_directory_are_the_users_or_the_readers_group_only(tmp_path: Path, usual_umask) -> None:
    """0600/0700 by default, 0640/0750 with the readers' group (server.local.group): the intermediate directories
    too (they were 0755, from the umask)."""
    shared = Region(tmp_path / "s", writable=True, access=StoreAccess(READERS_GID))
    shared.create("tables/1/rows", (4, 4), np.float32)
    assert _modes(tmp_path / "s") == {".": (0o750, READERS_GID), "tables": (0o750, READERS_GID),
                                      "tables/1": (0o750, READERS_GID), "tables/1/rows": (0o640, READERS_GID)}
    private = Region(tmp_path / "p", writable=True, access=PRIVATE)
    private.create("a/b/x", (1,), np.int64)
    assert {bits for bits, _ in _modes(tmp_path / "p").values()} == {0o700, 0o600}
    assert _modes(tmp_path / "p")["a/b/x"][0] == 0o600


@pytest.mark.parametrize("access", [PRIVATE, StoreAccess(READERS_GID)], ids=["private", "readers-group"])
def test_a_node_store_is_made_with_its_access_throughout(tmp_path: Path, access: StoreAccess, usual_umask) -> None:
    root = tmp_path / "shm" / "hps"  # neither exists: both are made by the store
    store = NodeStore(root, private=False, processes=2, workers=1, access=access)
    try:
        store.new_table("m", "t", 4, "zeros")
        store.publish([], {})
        modes = _modes(tmp_path / "shm")
        dirs = {k for k, _ in modes.items() if (tmp_path / "shm" / k).is_dir()}
        assert {modes[k] for k in dirs} == {(access.dir_mode, access.gid or os.getgid())}
        assert {v for k, v in modes.items() if k not in dirs} == {(access.file_mode, access.gid or os.getgid())}
        assert len(modes) > 10
    finally:
        store.close()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's own temp directory is private to its user)."""
    path = Path(tempfile.mkdtemp(prefix="hps-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="switching to another user needs root, and a Python that user may run")
def test_another_user_cannot_map_the_store_but_the_group_can(open_dir: Path) -> None:
    region = Region(open_dir / "s", writable=True, access=StoreAccess(READERS_GID))
    region.create("rows", (4, 4), np.float32)
    probe = ("import mmap, sys\nf = open(sys.argv[1], 'rb')\nmmap.mmap(f.fileno(), 64, prot=mmap.PROT_READ)\n"
             "print('mapped')")
    path = str(region.path / "rows")
    gid = os.stat(path).st_gid
    assert gid == READERS_GID

    def as_nobody(*groups: int) -> subprocess.CompletedProcess:
        def drop() -> None:
            os.setgroups(list(groups))
            os.setgid(65534)
            os.setuid(65534)
        return subprocess.run([SYSTEM_PYTHON, "-c", probe, path], capture_output=True, text=True, preexec_fn=drop,
                              timeout=60, cwd="/")

    other = as_nobody()
    assert other.returncode != 0 and "PermissionError" in other.stderr
    member = as_nobody(gid)
    assert member.returncode == 0 and "mapped" in member.stdout, member.stderr


def _fake_cgroup(tmp_path: Path, quota: str | None, v1: tuple[int, int] | None) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    v2, cpu = tmp_path / "cg2", tmp_path / "cpu"
    (v2 / "kubepods" / "pod1").mkdir(parents=True)
    (cpu / "pod1").mkdir(parents=True)
    lines = [f"30 20 0:26 / {v2} rw - cgroup2 cgroup2 rw"]
    if quota is not None:
        (v2 / "kubepods" / "pod1" / "cpu.max").write_text(f"{quota} 100000\n")
        (v2 / "kubepods" / "cpu.max").write_text("max 100000\n")
    if v1 is not None:
        lines.append(f"31 20 0:27 /kubepods {cpu} rw - cgroup cgroup rw,cpu,cpuacct")
        (cpu / "pod1" / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (cpu / "pod1" / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
    (proc / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1\n4:cpu,cpuacct:/kubepods/pod1\n")
    return proc


def test_usable_cpus_follow_the_cgroup_limit_then_the_affinity_mask(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(_fake_cgroup(tmp_path / "a", "150000", None)) == 1.5
    assert usable_cpus(_fake_cgroup(tmp_path / "b", "150000", None)) == min(2, affinity_cpus())  # 1.5 CPUs: 2
    assert cgroup_cpu_limit(_fake_cgroup(tmp_path / "c", "max", None)) is None
    assert cgroup_cpu_limit(_fake_cgroup(tmp_path / "d", None, (50000, 100000))) == 0.5
    assert usable_cpus(_fake_cgroup(tmp_path / "e", None, (50000, 100000))) == 1
    assert cgroup_cpu_limit(_fake_cgroup(tmp_path / "f", None, (-1, 100000))) is None
    # this machine: whatever its limit, never more than the affinity mask allows
    assert 1 <= usable_cpus() <= affinity_cpus() == len(os.sched_getaffinity(0))


def test_a_store_of_another_layout_is_refused_by_name(tmp_path: Path) -> None:
    """A reader never maps a store of an older layout (layout 1's tombstones would read as rows, layout 2's converted
    tables as missing)."""
    store = NodeStore(tmp_path / "hps", private=False, processes=2, workers=1)
    try:
        store.publish([], {})
        assert StoreView(store.path, writable=False).generation == store.generation
        store.header[layout.H_LAYOUT] = layout.LAYOUT_VERSION - 1  # what the release before wrote
        with pytest.raises(UnavailableError, match=f"not an hps store of layout {layout.LAYOUT_VERSION}"):
            StoreView(store.path, writable=False)
    finally:
        store.close()


def test_a_reader_that_mapped_a_dropped_table_maps_the_one_created_again_under_its_id(tmp_path: Path) -> None:
    """The hash map's arrays of a table created again under a dropped table's id lie elsewhere in the store, and
    the manifest says where: a reader that mapped the dropped one reads the new one after its next reload (and
    lets the dropped one's mapping go), never the freed rows."""
    from hps_service.node.store.view import StoreView
    from hps_service.tiers.hashmap.tier import HashMapTier

    store = NodeStore(tmp_path / "hps", private=False, processes=2, workers=1)
    placement = store.volatile_placement()
    tier = HashMapTier(1000, allocator=placement.alloc, release=placement.release)
    keys = np.arange(1, 9, dtype=np.int64)
    tier.create_table("m.t", 4)
    tier.put("m.t", keys, np.ones((8, 4), np.float32), np.ones(8, np.int64))
    store.publish([], {})
    view = StoreView(store.path, writable=False)
    first = view.volatile("m.t")
    assert first is not None and (first.get(keys).vectors == 1).all()
    tier.drop_table("m.t")  # no manifest between the drop and the new table: the reader sees only the new one
    tier.create_table("m.t", 4)
    tier.put("m.t", keys, np.full((8, 4), 2, np.float32), np.ones(8, np.int64))
    store.publish([], {})
    view.reload()
    again = view.volatile("m.t")
    assert again is not None and again is not first
    assert (again.get(keys).vectors == 2).all()
    store.close()


def test_unpoint_current_removes_its_own_link_and_keeps_a_newer_owners(tmp_path: Path) -> None:
    """A clean stop removes ``current`` when it names the stopping generation; when a newer owner already points
    it at its own generation (two owners overlapping on one root), that link stays."""
    from hps_service.node.store import layout

    old, new = tmp_path / "gen-1", tmp_path / "gen-2"
    old.mkdir()
    new.mkdir()
    layout.point_current(tmp_path, old)
    assert layout.unpoint_current(tmp_path, old)
    assert not (tmp_path / "current").is_symlink()
    assert not layout.unpoint_current(tmp_path, old)  # nothing left to remove
    layout.point_current(tmp_path, new)
    assert not layout.unpoint_current(tmp_path, old)
    assert layout.current_generation(tmp_path) == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "gen-1", "gen-2"]  # nothing set aside is left
