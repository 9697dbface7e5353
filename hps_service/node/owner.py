"""The owner process of a node: the single writer of everything the workers read.

It creates the shared store, builds the engine with the hash map's arrays (and L1's, where the cache places them)
in it, publishes the served tables in the store's manifest, applies the rows its workers hand over (admissions into
L1, promotions into L2) from their queues, notes every RocksDB write in the tables' change rings, and adds the
workers' counters to /v1/stats and /metrics. The update consumer, the REST admin API and the jobs run here as in a
single-process server; the workers only read.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hps_service.cache import build_table_cache
from hps_service.cache.protocol import FetchBelow, TableCache
from hps_service.cache.table_cache import WarmKeys
from hps_service.config import HPSConfig, ModelConfig
from hps_service.engine import LEVELS, LookupEngine, ServedTable
from hps_service.engine.l1_choice import l1_enabled
from hps_service.engine.l1_sizing import plan_l1
from hps_service.engine.promote import promote
from hps_service.engine.registry import described
from hps_service.engine.stats import TableStats
from hps_service.fleet.registrations import serve_registered
from hps_service.node.manifest_wait import wait_workers_serve
from hps_service.node.shared_l1 import cache_entry
from hps_service.node.store import layout
from hps_service.node.store import node_store as ns
from hps_service.node.store.l3_events import L3Announcer
from hps_service.node.store.node_store import T_L1_GEN, T_WRITE_GEN, NodeStore, TableSlot
from hps_service.node.supervisor import WorkerProgram, WorkerSupervisor, reserve_port
from hps_service.node.worker_engine import KIND_ADMIT, KIND_PROMOTE
from hps_service.runtime.gate import ServingGate
from hps_service.shm.counters import REQ_LATENCY, REQ_STATUS, TABLE_DEFAULTS, TABLE_HITS, TABLE_MISSES
from hps_service.shm.permissions import local_access
from hps_service.shm.queue import Record
from hps_service.shm.region import array_spec
from hps_service.shm.usage import resident_bytes
from hps_service.tiers.registry import open_tiers

log = logging.getLogger(__name__)

#: How often the owner refreshes its GetClusterInfo answer in the store (``layout.CLUSTER_INFO``).
CLUSTER_INFO_PERIOD_S = 0.5
#: The least time between two drains of the workers' queues: on a mix of hits and misses every lookup hands over the
#: rows it fetched, and a drain per lookup cost the owner about 0.12 ms of CPU a call (its wake-up, and the
#: per-record work); gathering 5 ms of records cut that to about 0.075 ms. A wake-up after a quiet spell drains at
#: once, so a lone lookup's rows are in L1 for the next one (the queues hold 8 MiB, hundreds of lookups' offers).
DRAIN_GATHER_S = 0.005


def store_parent() -> Path:
    """Where a private store goes: memory-backed ``/dev/shm`` when there is one, else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class OwnerEngine(LookupEngine):
    """The engine of a node's owner: each served table gets its shared state in the store, and its statistics
    include what the workers counted."""

    def __init__(self, config: HPSConfig, store: NodeStore) -> None:
        self.config = config
        self.store = store
        self._slots: dict[int, TableSlot] = {}  # id(ServedTable) -> its slot
        self._served: dict[int, ServedTable] = {}  # serial -> table
        self._slot_lock = threading.Lock()
        volatile, persistent = open_tiers(config.volatile, config.persistent, store.volatile_placement(),
                                          on_write=self._l3_written,
                                          file_events=L3Announcer(store.header))
        l1 = l1_enabled(config.cache, config.volatile)
        super().__init__(volatile, persistent, cache_factory=self._cache_factory if l1 else None,
                         max_batch_keys=config.server.max_batch_keys)

    # ---- tables -------------------------------------------------------------------------------
    def _slot(self, t: ServedTable) -> TableSlot:
        with self._slot_lock:
            slot = self._slots.get(id(t))
            if slot is None:
                slot = self.store.new_table(t.model, t.name, t.dim, _default_json(t.default), t.storage,
                                            t.stored_as)
                self._slots[id(t)] = slot
                self._served[slot.serial] = t
            return slot

    def _cache_factory(self, t: ServedTable, fetch_below: FetchBelow, warm_keys: WarmKeys | None) -> TableCache | None:
        """The table's L1 with its arrays in the store (as files ``l1/<serial>/<n>``), listed in its manifest entry
        for the workers, and its change generation published where they read it."""
        slot = self._slot(t)
        cfg = self.config
        plan = plan_l1(cfg, t.id, (self.volatile, self.persistent), self.persistent is not None)
        made: list[tuple[np.ndarray, dict[str, Any]]] = []
        region = self.store.region

        def alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            name = f"l1/{slot.serial}/{len(made)}"
            arr = region.create(name, shape, dtype)
            made.append((arr, array_spec(name, arr)))
            return arr

        cache = build_table_cache(cfg.cache, t.format.words, plan.rows, fetch_below, warm_keys, plan.snapshot, alloc=alloc)
        share = cache.host_share() if cache is not None else None
        if share is not None:
            specs = {field: next(spec for arr, spec in made if arr is getattr(share.arrays, field))
                     for field in ("tags", "keys", "versions", "clock", "values", "meta")}
            slot.entry["l1"] = cache_entry(specs, share.arrays, cfg.cache.policy)
            share.publish_generation_to(slot.control, T_L1_GEN)
        elif cache is not None:
            log.warning("L1 of %s is in device memory, which the gRPC worker processes do not share (CUDA IPC is not "
                        "implemented): they answer from the hash map and RocksDB. Use cache.backend: numpy, or "
                        "server.workers: 0 to serve gRPC from this process", t.id)
        return cache

    def register_model(self, model: ModelConfig) -> None:
        old = set(self._slots_of(model.served_name))
        super().register_model(model)
        self._drop_slots(old)

    def _announce(self, served: str) -> None:
        """Publish the new tables and wait until every worker serves them, with their write locks still held: a write
        acknowledged after this reaches tables that every worker reads (see ``LookupEngine.register_model``)."""
        for t in self.registry.tables().get(served, {}).values():
            t.guard.mirror_to(self._slot(t).control, T_WRITE_GEN)
        self.publish()
        wait_workers_serve(self.store, self.config.server.worker_processes(), described(served))

    def unregister_model(self, name: str) -> None:
        """Unpublished first, its shared arrays freed once every worker serves without them."""
        old = set(self._slots_of(name))
        super().unregister_model(name)
        self.publish()
        try:
            wait_workers_serve(self.store, self.config.server.worker_processes(), f"the unload of model {name}")
        finally:
            self._drop_slots(old)

    def drop_version(self, model: str, version: int) -> dict[str, int]:
        """Unpublished before its rows are freed (:meth:`unregister_model`), and published again after, so no reader
        keeps the freed arrays mapped."""
        freed = super().drop_version(model, version)
        self.publish()
        return freed

    def finish_drop(self, name: str, tables: dict[str, str]) -> dict[str, int]:
        freed = super().finish_drop(name, tables)
        self.publish()
        return freed

    def set_label(self, model: str, label: str, version: int | None) -> int | None:
        """Switch the label here, then in every worker: it returns once they all read the new version."""
        before = super().set_label(model, label, version)
        self.publish()
        wait_workers_serve(self.store, self.config.server.worker_processes(), f"label {label} of model {model}")
        return before

    def _slots_of(self, model: str) -> list[int]:
        with self._slot_lock:
            return [s for s, t in self._served.items() if t.model == model]

    def _drop_slots(self, serials: set[int]) -> None:
        live = {id(t) for tables in self.registry.tables().values() for t in tables.values()}
        with self._slot_lock:
            for serial in serials:
                t = self._served.get(serial)
                if t is not None and id(t) not in live:
                    del self._served[serial]
                    self._slots.pop(id(t), None)
                    self.store.drop_table(serial)

    def publish(self) -> None:
        """Write the manifest: the served models and, per table, where its shared state is."""
        served: dict[str, dict[str, int]] = {}
        with self._slot_lock:
            serial_of = {id(t): s.serial for s in self._slots.values() for t in [self._served[s.serial]]}
        for model, tables in self.registry.tables().items():
            served[model] = {name: serial_of[id(t)] for name, t in tables.items() if id(t) in serial_of}
        self.store.publish([m.model_dump(mode="json") for m in self.served_models()], served,
                           {model: dict(labels) for model, labels in self.labels.current().items()})

    def served_table(self, serial: int) -> ServedTable | None:
        """The table a worker means by ``serial``, if it is still the one served."""
        t = self._served.get(serial)
        return t if t is not None and self.registry.is_served(t) else None

    # ---- writes the workers cannot make -------------------------------------------------------
    def _l3_written(self, table: str, keys: np.ndarray | None) -> None:
        """RocksDB took a write batch: note its keys where the workers' secondary instances look."""
        with self._slot_lock:
            slots = [s for s in self._slots.values() if self._served[s.serial].id == table]
        for slot in slots:
            slot.changes.append(keys)

    def apply_offer(self, record: Record) -> None:
        """Rows a worker handed over: an admission into L1 or a promotion into L2, as the engine would have made."""
        t = self.served_table(record.table)
        if t is None:
            return
        if record.kind == KIND_ADMIT and t.cache is not None:
            t.cache.admit(record.keys, record.rows, record.versions, record.hit_rate, fetched_at=record.generation)
        elif record.kind == KIND_PROMOTE and self.volatile is not None:
            promote(self.volatile, t, record.keys, record.rows, record.versions, record.generation)

    # ---- statistics ---------------------------------------------------------------------------
    def table_stats(self, model: str, table: str) -> TableStats:
        """The engine's figures plus every worker's hits, misses and defaults."""
        t = self.table(model, table)
        out = super().table_stats(model, table)
        with self._slot_lock:
            slot = self._slots.get(id(t))
        if slot is None:
            return out
        sums = slot.counters.sum(axis=(0, 1))
        for i, level in enumerate(LEVELS):
            entry = out[level]
            hits = int(entry["hits"] or 0) + int(sums[TABLE_HITS + i])
            misses = int(entry["misses"] or 0) + int(sums[TABLE_MISSES + i])
            entry["hits"], entry["misses"] = hits, misses
            entry["hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
        out["default"]["hits"] = int(out["default"]["hits"] or 0) + int(sums[TABLE_DEFAULTS])
        return out


def _default_json(default: Any) -> Any:
    return default.model_dump() if hasattr(default, "model_dump") else default


_W_STATE_NAMES = {ns.W_NONE: "none", ns.W_STARTING: "starting", ns.W_READY: "ready", ns.W_FAILED: "failed",
                  ns.W_STOPPED: "stopped"}


class NodeCollector(Collector):
    """``hps_node_workers{state}``, ``hps_node_worker_restarts_total``, ``hps_node_admissions_dropped_total`` and
    ``hps_node_worker_rocksdb_bytes{kind}``."""

    def __init__(self, owner: NodeOwner) -> None:
        self.owner = owner

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        states = GaugeMetricFamily("hps_node_workers", "gRPC worker processes by state", labels=["state"])
        counts: dict[str, int] = dict.fromkeys(_W_STATE_NAMES.values(), 0)
        for i in range(self.owner.workers):
            counts[_W_STATE_NAMES.get(int(self.owner.store.workers[i, ns.W_STATE]), "none")] += 1
        for state, n in counts.items():
            states.add_metric([state], n)
        restarts = CounterMetricFamily("hps_node_worker_restarts", "gRPC worker processes started again after "
                                       "they died")
        restarts.add_metric([], self.owner.supervisor.restarts)
        rows = self.owner.store.workers[: self.owner.workers]
        dropped = CounterMetricFamily("hps_node_admissions_dropped", "rows of L1 misses a worker could not hand to "
                                      "the owner for admission (its queue was full); counts restart with a worker")
        dropped.add_metric([], int(rows[:, ns.W_ADMISSIONS_DROPPED].sum()))
        memory = GaugeMetricFamily("hps_node_worker_rocksdb_bytes", "memory of the workers' RocksDB secondary "
                                   "instances, all workers together", labels=["kind"])
        memory.add_metric(["memtables"], int(rows[:, ns.W_MEMTABLE_BYTES].sum()))
        memory.add_metric(["block_cache"], int(rows[:, ns.W_BLOCK_CACHE_BYTES].sum()))
        shared = GaugeMetricFamily("hps_node_shared_memory_bytes", "memory the node's shared store (L1 and the hash "
                                   "map, on /dev/shm) holds: counted in the pod's memory, not in any process's RSS")
        shared.add_metric([], resident_bytes(self.owner.store.path))
        yield from (states, restarts, dropped, memory, shared)


class NodeGate(ServingGate):
    """The owner's gate in a node: opening or closing it also opens or closes the workers' (the store's state)."""

    def __init__(self, store: NodeStore) -> None:
        super().__init__()
        self._store = store

    def open(self) -> None:
        super().open()
        self._store.set_state(layout.SERVING)

    def close(self, reason: str) -> None:
        super().close(reason)
        if self._store.state != layout.STARTING:  # closed while starting (compiling kernels): still starting
            self._store.set_state(layout.DRAINING)


class NodeOwner:
    """The owner's part of a node: the store, the engine, the workers and the queue from them."""

    def __init__(self, config: HPSConfig, log_level: int, program: WorkerProgram) -> None:
        cfg = config.server
        self.config = config
        self.workers = cfg.worker_processes()
        local = cfg.local
        self.store = NodeStore(local.path if local.enabled else store_parent(), private=not local.enabled,
                               processes=self.workers + 1, workers=self.workers,
                               ring_keys=config.persistent.change_ring_keys, access=local_access(local))
        if (uds := cfg.local_socket()) is not None:  # where LocalClient readers send their misses
            self.store.extra["socket"] = str(uds)
        WorkerSupervisor.prepare(program)
        self.wake = multiprocessing.get_context("forkserver").Semaphore(0)
        self.supervisor = WorkerSupervisor(config, self.store, self.wake, log_level, program)
        self.engine: OwnerEngine | None = None
        self._port_sock: Any = None
        self._stop = threading.Event()
        self._drain: threading.Thread | None = None
        self._publisher: threading.Thread | None = None
        self.gate = NodeGate(self.store)
        self._health: dict[str, int] = {}

    def build_engine(self) -> OwnerEngine:
        engine = OwnerEngine(self.config, self.store)
        for model in self.config.models:
            engine.register_model(model)
        serve_registered(engine, {m.name for m in self.config.models})  # before the restart: as a single process
        engine.publish()
        self.engine = engine
        self._check_room()
        return engine

    def _check_room(self) -> None:
        """Warn when the tables could outgrow the store's filesystem: a write to a page it cannot back kills the
        process that makes it (SIGBUS), so the memory-backed volume must hold the capacities, not only the rows."""
        region = self.store.region
        room = region.room()  # checked at start, before the tables hold many rows
        if region.reserved > room:
            log.warning("the shared store may grow to %.1f GiB (L1 and hash-map capacities) but %s holds %.1f GiB: "
                        "enlarge the memory-backed volume (the chart's sharedMemory.sizeLimit, /dev/shm) or lower "
                        "cache.capacity / volatile.capacity_rows", region.reserved / 2**30, self.store.root,
                        room / 2**30)

    def reserve_port(self) -> int:
        cfg = self.config.server
        self._port_sock = reserve_port(cfg.host, cfg.grpc_port)
        return int(self._port_sock.getsockname()[1])

    def start_workers(self, port: int) -> None:
        self._drain = threading.Thread(target=self._drain_queues, name="hps-worker-queues", daemon=True)
        self._drain.start()
        self.supervisor.start(port)

    def publish_health(self, statuses: dict[str, int]) -> None:
        """The owner's gRPC health statuses (service name -> status), for the workers to answer (when they change)."""
        if statuses != self._health:
            self.store.write_json(layout.HEALTH, statuses)
            self.store.header[layout.H_HEALTH] += 1  # after the file is in place: a worker that sees it reads it
            self._health = dict(statuses)

    def publish_cluster_info(self, cluster_info: Callable[[], dict[str, Any]]) -> None:
        """Keep the owner's GetClusterInfo answer (shard map, readiness) where workers read it, every
        ``CLUSTER_INFO_PERIOD_S``: readiness is the owner's to judge (the consumer, the tiers)."""

        def loop() -> None:
            last = None
            while True:
                try:
                    info = cluster_info()
                    if info != last:
                        self.store.write_json(layout.CLUSTER_INFO, info)
                        last = info
                except Exception:  # the workers keep the last answer
                    log.debug("cluster info not published", exc_info=True)
                if self._stop.wait(CLUSTER_INFO_PERIOD_S):
                    return

        self._publisher = threading.Thread(target=loop, name="hps-cluster-info", daemon=True)
        self._publisher.start()

    def _drain_queues(self) -> None:
        """Apply what the workers handed over; woken by the semaphore a worker releases when its queue goes from empty
        to not empty, and never sooner than ``DRAIN_GATHER_S`` after the last drain (see there)."""
        drained_at = 0.0
        while not self._stop.is_set():
            if self.wake.acquire(timeout=0.1):
                early = drained_at + DRAIN_GATHER_S - time.monotonic()
                if early > 0:
                    self._stop.wait(early)  # under load: let the workers' next records join this drain
            drained_at = time.monotonic()
            for ring in self.store.queues:
                try:
                    records = ring.pop_all()
                except Exception:
                    log.exception("a worker queue is unreadable; its records are lost")
                    continue
                for record in records:
                    try:
                        assert self.engine is not None
                        self.engine.apply_offer(record)
                    except Exception:  # an admission or promotion is an optimisation: log, go on
                        log.warning("applying rows a worker handed over failed", exc_info=True)

    def stats(self) -> dict[str, Any]:
        """The ``node`` section of /v1/stats: each worker's pid, state, starts and requests served, the store, and
        per table how many keys its change ring noted (a ring of ``slots`` laps every ``slots`` of them)."""
        status = self.store.workers
        per_process = self.store.requests[:, :, REQ_STATUS:REQ_LATENCY].sum(axis=(1, 2))
        workers = [{"index": i, "pid": int(status[i, ns.W_PID]), "state": _W_STATE_NAMES.get(int(status[i, ns.W_STATE])),
                    "starts": int(status[i, ns.W_STARTS]), "requests": int(per_process[i + 1]),
                    "memtable_bytes": int(status[i, ns.W_MEMTABLE_BYTES]),
                    "block_cache_bytes": int(status[i, ns.W_BLOCK_CACHE_BYTES]),
                    "admissions_dropped": int(status[i, ns.W_ADMISSIONS_DROPPED])}
                   for i in range(self.workers)]
        rings = {slot.entry["model"] + "." + slot.entry["table"]: {"keys_noted": slot.changes.position(),
                                                                    "slots": slot.changes.size}
                 for slot in self.store.table_slots().values()}
        return {"workers": workers, "restarts": self.supervisor.restarts,
                "given_up": [self.supervisor.given_up[i] for i in sorted(self.supervisor.given_up)],
                "owner_requests": int(per_process[0]),
                "store": str(self.store.path), "change_rings": rings}

    def workers_not_serving(self) -> str | None:
        """A readiness check: which gRPC workers do not serve now (None when every one does), so that a node whose
        workers crash never says ready."""
        return "; ".join(self.supervisor.not_serving()) or None

    def stop_workers(self, grace: float) -> None:
        self.supervisor.stop(grace)
        if self._port_sock is not None:
            self._port_sock.close()
            self._port_sock = None

    def close(self) -> None:
        """After the engine closed: stop the queue thread and remove the store."""
        self._stop.set()
        for thread in (self._drain, self._publisher):
            if thread is not None:
                thread.join(2)
        self.store.close()
