"""Where a store lives and how a reader knows it is the live one.

A store root holds one directory per *generation* (one start of the owner) and a ``current`` symlink to the
live one, replaced atomically when a new owner starts and removed when its owner stops cleanly. Each generation has a ``header`` (int64 fields below), a
``lock`` file the owner holds an exclusive ``flock`` on for as long as it lives (the kernel drops it when the owner
dies, however it dies, so a reader that can take a shared lock knows the owner is gone) and a ``manifest.json``
(written by :mod:`hps_service.node.store.node_store`, read by :mod:`hps_service.node.store.view`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

from hps_service.shm.permissions import StoreAccess

#: Header fields (int64): magic, layout version, generation id, state, manifest generation, owner pid, the
#: owner's RocksDB announcements to its workers' secondary instances (:mod:`hps_service.node.store.l3_events`), and
#: how many times the owner replaced ``HEALTH`` (a worker reads the file again only when it changed).
H_MAGIC, H_LAYOUT, H_GENERATION, H_STATE, H_MANIFEST, H_OWNER_PID = 0, 1, 2, 3, 4, 5
H_L3_FILES, H_L3_OPENS, H_HEALTH = 6, 7, 8
HEADER_LEN = 16
MAGIC = 0x4850535354524531  # "HPSSTRE1"
#: 2: four-byte L1 clocks, and the hash map's owner and reader stamps as int32 halves of each row's third metadata
#: word (a reader of layout 1 would take a tombstone for a row). 3: a table's entry names the tier id of its rows
#: (``stored_as``: a converted table's is not ``model.table``, which a reader of layout 2 would look in). 4: the
#: manifest holds model versions and their labels (a reader of layout 3 would answer a request that names no
#: version from the model as configured, not from the version its label ``production`` names). 5: a hash-map table's
#: manifest entry lists its arrays' specs (``arrays``, ``writable``), as L1's does, instead of the capacity and dim a
#: reader of layout 4 would look for.
LAYOUT_VERSION = 5
#: Store states: the owner is loading, serving, draining (refuse new lookups), or has closed the generation.
STARTING, SERVING, DRAINING, CLOSED = 0, 1, 2, 3
STATE_NAMES = {STARTING: "starting", SERVING: "serving", DRAINING: "draining", CLOSED: "closed"}

CURRENT = "current"
LOCK = "lock"
HEADER = "header"
MANIFEST = "manifest.json"
#: The owner's GetClusterInfo answer (shard map, readiness) and gRPC health statuses, for the workers to give.
CLUSTER_INFO = "cluster.json"
HEALTH = "health.json"
PRIVATE_PREFIX = "hps-node-"


def generation_dir(root: Path, generation: int) -> Path:
    return root / f"gen-{generation:016x}"


def new_generation_id() -> int:
    """A generation id that differs from every earlier one of this root (time-based, 62 bits, never 0)."""
    return (time.time_ns() ^ (os.getpid() << 40)) & ((1 << 62) - 1) or 1


def make_generation(root: Path, generation: int, access: StoreAccess) -> tuple[Path, int]:
    """Create the directory of a new generation with its owner lock held; returns (directory, lock fd: closing it
    releases the lock). Built under a hidden name and renamed into place, so a sweep of dead generations never
    sees it before its lock is held."""
    building = root / f".new-{generation:016x}"
    access.make_dirs(building)
    fd = os.open(building / LOCK, os.O_RDWR | os.O_CREAT, access.file_mode)
    access.apply_fd(fd, building / LOCK)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    final = generation_dir(root, generation)
    os.rename(building, final)
    return final, fd


def owner_alive(lock_path: Path) -> bool:
    """Whether the owner of a generation still holds its lock (a shared lock cannot be had while it does)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing also drops a lock we got
    return False


def current_generation(root: Path) -> Path | None:
    """The live generation directory of ``root`` (the target of ``current``), or None."""
    try:
        target = os.readlink(root / CURRENT)
    except OSError:
        return None
    return root / target


def point_current(root: Path, gen_dir: Path) -> None:
    """Make ``current`` name ``gen_dir`` in one step (a new link renamed over the old one)."""
    tmp = root / f".{CURRENT}.{os.getpid()}"
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    os.symlink(gen_dir.name, tmp)
    os.replace(tmp, root / CURRENT)


def unpoint_current(root: Path, gen_dir: Path) -> bool:
    """Remove ``current`` if it names ``gen_dir`` (a clean stop leaves no link to a removed generation); a newer
    owner's link stays. The link is first renamed aside, so that it is judged and removed in one step; a link that
    turns out to be another owner's is linked back unless a still newer one took its place. Returns whether it
    was removed."""
    aside = root / f".{CURRENT}.{os.getpid()}.stopping"
    try:
        os.rename(root / CURRENT, aside)
    except FileNotFoundError:
        return False
    try:
        ours = os.readlink(aside) == gen_dir.name
        if not ours:
            try:
                os.link(aside, root / CURRENT, follow_symlinks=False)
            except FileExistsError:
                pass  # a newer owner pointed it meanwhile: its link stands
        return ours
    finally:
        aside.unlink()


def remove_dead_generations(root: Path, keep: Path | None = None) -> None:
    """Delete the generation directories of ``root`` whose owner is gone (readers that mapped them keep their
    mappings until they drop them)."""
    for d in root.glob("gen-*"):
        if d != keep and not owner_alive(d / LOCK):
            shutil.rmtree(d, ignore_errors=True)


def remove_dead_private_roots(parent: Path) -> None:
    """Delete private stores (``hps-node-*``) of this user left behind by owners that were killed."""
    uid = os.getuid()
    for root in parent.glob(f"{PRIVATE_PREFIX}*"):
        try:
            if root.stat().st_uid != uid:
                continue
        except OSError:
            continue
        gens = list(root.glob("gen-*"))
        if gens and not any(owner_alive(g / LOCK) for g in gens):
            shutil.rmtree(root, ignore_errors=True)
