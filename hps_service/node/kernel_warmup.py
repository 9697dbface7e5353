"""Every compiled kernel of the node's store and of its readers (the workers' and a LocalClient's paths: shared
hash-map and L1 reads with read-only arrays and keys, counters, queues, change rings), run once on tiny arrays: the
owner runs it before it says ready (``hps_service.jit.warmup``), the fork server before it forks workers."""

from __future__ import annotations

import numpy as np

from hps_service.cache.layout import CacheArrays
from hps_service.jit.views import read_only_view
from hps_service.keys import distinct_with_inverse, unique_with_inverse
from hps_service.node.shared_l1 import WORKER_WRITABLE, SharedL1Reader, cache_entry
from hps_service.node.store.l3_events import L3Announcer, l3_events
from hps_service.shm import changes, counters, queue
from hps_service.tiers.hashmap import seqlock as hk
from hps_service.tiers.hashmap.index import EMPTY
from hps_service.tiers.hashmap.reader import TableArrays, TableReader
from hps_service.tiers.hashmap.stamps import stamp_halves


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)  # numba compiles read-only arrays separately: warm what the workers map
    return arr


def warm_up_kernels() -> None:
    """Compile (or load) the node's kernels with every argument type its paths pass."""
    ctrl = np.zeros(hk.CTRL_LEN, np.int64)
    index = _read_only(np.full(16, EMPTY, np.int32))
    writable_meta = np.zeros((4, 3), np.int64)  # a worker's mapping (it writes its stamps), a LocalClient's read-only
    rows = _read_only(np.zeros((4, 2), np.float32))
    keys = np.arange(3, dtype=np.int64)
    out = np.empty((3, 2), np.float32)
    versions = np.empty(3, np.int64)
    found = np.empty(3, bool)
    row_ids = np.empty(3, np.int64)
    # as TableReader.fill calls it: the columns it reads and the request's keys as read-only views (jit/views.py)
    hk.read_rows_at(ctrl, index, np.int64(0), read_only_view(writable_meta[:, 0]), rows,
                    read_only_view(writable_meta[:, 1]), read_only_view(stamp_halves(writable_meta)[0]),
                    read_only_view(keys), np.flatnonzero(found | True), out, versions, found, row_ids)
    hk.stamp_reads(stamp_halves(writable_meta)[1], row_ids, hk.tick(ctrl), False)
    sources = np.empty(3, np.uint8)
    for stamps in (stamp_halves(writable_meta)[1], None):  # the compiled pass of a worker, then of a LocalClient
        lane = TableReader(TableArrays(ctrl, writable_meta, rows, stamps, index, 0), lambda gen: index, False).lane()
        lane(_read_only(keys.copy()), out, sources, row_ids)
    req = counters.RequestCounters(counters.new_counters(1, counters.REQ_FIELDS), 0)
    req.finish(req.begin(), 0, 0, 0.001)
    req.observe_keys(3)
    req.observe_bags(2)
    ring = queue.Ring(np.zeros(queue.CTRL_LEN, np.int64), np.zeros(4096, np.uint8))
    ring.push(1, 1, 0, 0.5, keys, versions, out)
    ring.pop_all()
    changes.ChangeRing(np.zeros(16, np.int64), np.zeros(4, np.int64), 0).append(keys)
    unique_with_inverse(keys)
    distinct_with_inverse(keys)
    arrays = CacheArrays.allocate(1, 32, 2)
    shared = CacheArrays(**{f: getattr(arrays, f) if f in WORKER_WRITABLE else _read_only(getattr(arrays, f).copy())
                            for f in ("tags", "keys", "versions", "clock", "values", "meta")})
    entry = cache_entry({}, shared, "lru")
    fields = {f: getattr(shared, f) for f in ("tags", "keys", "versions", "clock", "values", "meta")}
    for touch in (True, False):  # a worker touches clocks, a LocalClient does not
        reader = SharedL1Reader(fields, entry, lambda: 0, None, touch=touch)
        reader.lookup(keys, out)
        reader.lookup(_read_only(keys.copy()), out)
    hk.seq_begin(ctrl)
    hk.seq_end(ctrl)
    req.observe_queue_wait(0.001)
    ring_view = changes.ChangeRing(np.zeros(16, np.int64), np.zeros(4, np.int64), 0)
    ring_view.append(keys)
    ring_view.stale(0, keys)
    mapped = changes.ChangeRing(_read_only(ring_view.keys.copy()), _read_only(ring_view.ctrl.copy()), 0)
    mapped.stale(0, np.array([-1], np.int64))  # as a worker maps a ring: read-only, and a key it does not hold
    header = np.zeros(16, np.int64)
    L3Announcer(header).begin()
    l3_events(_read_only(header))


