"""The owner's side of the shared store: creates a generation, places the arrays, publishes the manifest.

The manifest (``manifest.json``, replaced whole by a rename, then announced by bumping the header's manifest
generation) says what readers attach to:

* ``models``: the served models (their configs), ``served``: model -> table -> table serial;
* ``tables``: per serial, the model and table names, dim, default, the table's ``control`` array (published change
  generations and the RocksDB change ring position), its ``changes`` ring, its ``counters`` and its ``l1`` arrays;
* ``volatile``: per hash-map table, its arrays as placed (:mod:`hps_service.tiers.hashmap.layout`: a prefix of their
  own per table placed, each fixed array's file, shape and dtype, and which a reader may write; the index file changes
  as it grows: ``<prefix>/index.<ctrl[CTRL_INDEX_GEN]>``);
* ``requests`` (request counters), ``queues`` (one ring per worker), ``uds`` (where misses may be sent).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.node.store import layout
from hps_service.shm.changes import RING_KEYS, ChangeRing
from hps_service.shm.counters import REQ_FIELDS, TABLE_FIELDS, THREAD_ROWS
from hps_service.shm.permissions import PRIVATE, StoreAccess
from hps_service.shm.queue import CTRL_LEN as QUEUE_CTRL_LEN
from hps_service.shm.queue import Ring
from hps_service.shm.region import Region, array_spec
from hps_service.tiers.hashmap import layout as hashmap
from hps_service.tiers.placement import Placement

#: Indices into a table's control array (int64, one per cache line): the L1's change generation and the table's
#: write generation (``engine.write_guard``) as last published, and the position of its RocksDB change ring (its
#: reservation at ``T_CHANGES + 1``, see :mod:`hps_service.shm.changes`).
T_L1_GEN, T_WRITE_GEN, T_CHANGES = 0, 8, 16
TABLE_CTRL_LEN = 24
#: Bytes of each worker's queue to the owner.
QUEUE_BYTES = 8 << 20
#: Worker status fields (int64, one 64-byte row per worker): its pid, its state, how often it was started; as the
#: worker last reported them: its RocksDB secondary's memtable and block-cache bytes, the admission records it
#: dropped because its queue to the owner was full, and the manifest generation it serves (models and tables).
W_PID, W_STATE, W_STARTS, W_MEMTABLE_BYTES, W_BLOCK_CACHE_BYTES, W_ADMISSIONS_DROPPED = 0, 1, 2, 3, 4, 5
W_MANIFEST = 6
W_FIELDS = 8
#: Worker states.
W_NONE, W_STARTING, W_READY, W_FAILED, W_STOPPED = 0, 1, 2, 3, 4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


@dataclass
class TableSlot:
    """What the owner keeps of one served table's shared state."""

    serial: int
    control: np.ndarray
    changes: ChangeRing
    counters: np.ndarray
    entry: dict[str, Any]


class NodeStore:
    """One generation of the store, created and written by the owner."""

    def __init__(self, root: Path, *, private: bool, processes: int, workers: int,
                 queue_bytes: int = QUEUE_BYTES, ring_keys: int = RING_KEYS, access: StoreAccess = PRIVATE) -> None:
        """``processes``: rows of the counter arrays (the owner is 0, worker ``i`` is ``i + 1``); ``ring_keys``: slots
        of each table's change ring; ``access``: who may read the store beside the server's user (a private store is
        the server's alone)."""
        self.ring_keys = ring_keys
        self.private = private
        self.access = access = PRIVATE if private else access
        root = Path(root)
        if private:
            layout.remove_dead_private_roots(root)
            root = root / f"{layout.PRIVATE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            root.mkdir(mode=access.dir_mode)
        access.make_dirs(root)
        access.apply(root, access.dir_mode)
        self.root = root
        self.generation = layout.new_generation_id()
        self.path, self._lock_fd = layout.make_generation(root, self.generation, access)
        self.region = Region(self.path, writable=True, access=access)
        self.header = self.region.create(layout.HEADER, (layout.HEADER_LEN,), np.int64)
        self.header[layout.H_MAGIC] = layout.MAGIC
        self.header[layout.H_LAYOUT] = layout.LAYOUT_VERSION
        self.header[layout.H_GENERATION] = self.generation
        self.header[layout.H_OWNER_PID] = os.getpid()
        self.processes = processes
        self.requests = self.region.create("counters/requests", (processes, THREAD_ROWS, REQ_FIELDS), np.float64)
        self.workers = self.region.create("counters/workers", (max(1, workers), W_FIELDS), np.int64)
        self.queues: list[Ring] = []
        self._queue_specs: list[dict[str, Any]] = []
        for w in range(workers):
            ctrl = self.region.create(f"queues/{w}/ctrl", (QUEUE_CTRL_LEN,), np.int64)
            data = self.region.create(f"queues/{w}/data", (queue_bytes,), np.uint8)
            self.queues.append(Ring(ctrl, data))
            self._queue_specs.append({"ctrl": array_spec(f"queues/{w}/ctrl", ctrl),
                                      "data": array_spec(f"queues/{w}/data", data)})
        self._tables: dict[int, TableSlot] = {}
        self._next_serial = 1
        self._lock = threading.Lock()
        self._volatile: dict[str, dict[str, Any]] = {}
        self._volatile_prefix: dict[str, str] = {}  # hash-map table -> where its arrays are
        self._volatile_arrays: dict[str, dict[str, dict[str, Any]]] = {}  # hash-map table -> part -> array spec
        self._volatile_placed = 0
        self._placement: Placement | None = None
        self.extra: dict[str, Any] = {}
        self._closed = False

    # ---- placement ----------------------------------------------------------------------------
    def volatile_placement(self) -> Placement:
        """Where the hash-map tier's tables go: files under ``volatile/<n>.<table>/``, ``n`` counting the tables
        placed, so a table created again under a dropped one's id never takes its files and a reader that mapped the
        dropped one sees, by the prefix in the manifest, that it is another table."""
        def alloc(name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            table, _, part = name.rpartition("/")
            with self._lock:
                prefix = self._volatile_prefix.get(table)
                if prefix is None:
                    self._volatile_placed += 1
                    prefix = self._volatile_prefix[table] = f"volatile/{self._volatile_placed}.{table}"
                    self._volatile_arrays[table] = {}
            arr = self.region.create(f"{prefix}/{part}", shape, dtype)
            if part in hashmap.PARTS:  # the index's name follows its generation: readers derive it from ctrl
                with self._lock:
                    arrays = self._volatile_arrays[table]
                    arrays[part] = array_spec(f"{prefix}/{part}", arr)
                    if len(arrays) == len(hashmap.PARTS):  # every fixed array placed: readers may map the table
                        self._volatile[table] = {"prefix": prefix, "arrays": dict(arrays),
                                                 "writable": list(hashmap.READER_WRITABLE)}
            return arr

        def release(name: str) -> None:
            table, _, part = name.rpartition("/")
            with self._lock:
                prefix = self._volatile_prefix.get(table)
                if part == hashmap.CTRL:
                    self._volatile.pop(table, None)
                    self._volatile_prefix.pop(table, None)
                    self._volatile_arrays.pop(table, None)
            if prefix is not None:
                self.region.remove(f"{prefix}/{part}")

        self._placement = Placement(alloc, release)
        return self._placement

    def new_table(self, model: str, table: str, dim: int, default: Any, storage: str = "fp32",
                  stored_as: str = "") -> TableSlot:
        """Shared state of a newly served table (a replaced model's tables get new serials); ``storage`` and
        ``stored_as``: how and under which tier id its rows are stored."""
        with self._lock:
            serial = self._next_serial
            self._next_serial += 1
        base = f"tables/{serial}"
        control = self.region.create(f"{base}/control", (TABLE_CTRL_LEN,), np.int64)
        ring = self.region.create(f"{base}/changes", (self.ring_keys,), np.int64)
        counters = self.region.create(f"{base}/counters", (self.processes, THREAD_ROWS, TABLE_FIELDS), np.float64)
        entry = {"model": model, "table": table, "dim": int(dim), "default": default, "l1": None, "storage": storage,
                 "stored_as": stored_as,
                 "control": array_spec(f"{base}/control", control), "changes": array_spec(f"{base}/changes", ring),
                 "counters": array_spec(f"{base}/counters", counters)}
        slot = TableSlot(serial, control, ChangeRing(ring, control, T_CHANGES), counters, entry)
        with self._lock:
            self._tables[serial] = slot
        return slot

    def drop_table(self, serial: int) -> None:
        """Forget a table that is no longer served (after a manifest without it was published)."""
        with self._lock:
            slot = self._tables.pop(serial, None)
        if slot is not None:
            self.region.remove_tree(f"tables/{serial}")
            self.region.remove_tree(f"l1/{serial}")

    # ---- publication --------------------------------------------------------------------------
    def publish(self, models: list[dict[str, Any]], served: dict[str, dict[str, int]],
                labels: dict[str, dict[str, int]] | None = None) -> None:
        """Write the manifest for ``models`` (configs as dicts, versions included), ``served`` (served name -> table
        -> serial) and ``labels`` (model -> label -> version) and announce it: readers reload when they next look."""
        with self._lock:
            manifest = {
                "layout": layout.LAYOUT_VERSION, "generation": self.generation, "owner_pid": os.getpid(),
                "models": models, "served": served, "labels": labels or {},
                "tables": {str(s): slot.entry for s, slot in self._tables.items()},
                "volatile": {"lfu": self._placement is not None and self._placement.lfu,
                             "tables": dict(self._volatile)},
                "requests": array_spec("counters/requests", self.requests), "queues": self._queue_specs,
                "workers": array_spec("counters/workers", self.workers),
                "processes": self.processes, **self.extra,
            }
            self.write_json(layout.MANIFEST, manifest)
            self.header[layout.H_MANIFEST] += 1
        if int(self.header[layout.H_MANIFEST]) == 1:
            layout.point_current(self.root, self.path)
            if not self.private:
                layout.remove_dead_generations(self.root, keep=self.path)

    def write_json(self, name: str, data: Any) -> None:
        """Replace the small JSON file ``name`` of this generation whole (readers see the old or the new one)."""
        tmp = self.path / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self.access.file_mode)
        with os.fdopen(fd, "w") as f:
            self.access.apply_fd(f.fileno(), tmp)
            json.dump(data, f)
        os.replace(tmp, self.path / name)

    def workers_behind(self, count: int) -> list[int]:
        """The ready workers (of the first ``count``) that do not serve the manifest published last yet."""
        published = int(self.header[layout.H_MANIFEST])
        rows = self.workers[:count]
        return [i for i in range(count) if rows[i, W_STATE] == W_READY and rows[i, W_MANIFEST] < published
                and _alive(int(rows[i, W_PID]))]

    def table_slots(self) -> dict[int, TableSlot]:
        with self._lock:
            return dict(self._tables)

    def set_state(self, state: int) -> None:
        self.header[layout.H_STATE] = state

    @property
    def state(self) -> int:
        return int(self.header[layout.H_STATE])

    def close(self) -> None:
        """Mark the generation closed (readers fall back or wait for the next), release the owner lock and remove
        it: a private store entirely; a colocated one's generation, its ``current`` link unless a newer owner's
        replaced it, and the root when nothing else is left in it (a mounted volume's stays)."""
        if self._closed:
            return
        self._closed = True
        self.set_state(layout.CLOSED)
        os.close(self._lock_fd)
        if self.private:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        shutil.rmtree(self.path, ignore_errors=True)
        layout.unpoint_current(self.root, self.path)
        try:
            self.root.rmdir()
        except OSError:
            pass  # another generation, a reader's socket, or a mount point: not ours to remove
