"""A concurrent workload against running ``hps serve`` processes that records a :class:`History` (see :mod:`model`).

Writers: Kafka puts and tombstones from :class:`Publisher` threads, small batches and large ones that lap the
servers' change rings (acknowledged once the server's consumer has applied past the offsets the topic had when
``flush()`` returned, as ``/v1/stats`` reports), REST puts and admin deletes (acknowledged by the response), and REST
import jobs (acknowledged once the job succeeded). Readers: gRPC lookups and LocalClient lookups (the shared store
mapped, misses over the owner's socket). Keys come from a small space with the int64 edges and a skew, so with a small
L1 and a small hash map admission, eviction and promotion run all the time.

Servers may be SIGKILLed and restarted (:mod:`faults`): while one is down its calls fail; a failed write stays
unacknowledged (it may still apply), a failed read shows nothing. A replica's reads are checked against what that
replica acknowledged: a write is acknowledged there once the replica applied past its offsets.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import grpc
import httpx
import numpy as np
from confluent_kafka import Consumer, KafkaException, TopicPartition

from hps_client import Bags
from hps_client.channel import channel_options
from hps_client.errors import HPSError as ClientError
from hps_service.client import HPSClient
from hps_service.local import LocalClient
from hps_service.updates import Publisher
from hps_service.updates.partitioning import partition_of
from tests.history.model import History, Read, Write, decode_rows, encode_rows
from tests.history.server import TOKEN, VOLATILE_ROWS, HistoryServer

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Calls that fail while a server is down (or restarting, or closing its gate) and are not a defect then.
_DOWN_ERRORS = (httpx.HTTPError, grpc.RpcError, ClientError, ConnectionError, TimeoutError, OSError)
#: How long after a server is back a call may still fail: a gRPC channel that saw it down waits out its reconnect
#: backoff (hps_client's grpc.max_reconnect_backoff_ms, with gRPC's 20 % jitter) before it connects again.
_RECONNECT_S = dict(channel_options())["grpc.max_reconnect_backoff_ms"] / 1000 * 1.2 + 0.5


def key_space(n: int, seed: int = 14) -> np.ndarray:
    """``n`` distinct keys: the int64 edges, small ones, and random ones over the whole range."""
    rng = np.random.default_rng(seed)
    edges = np.array([INT64_MIN, INT64_MIN + 1, -1, 0, 1, INT64_MAX - 1, INT64_MAX], dtype=np.int64)
    rest = rng.integers(INT64_MIN, INT64_MAX, size=n * 2, dtype=np.int64, endpoint=True)
    keys = np.unique(np.concatenate((edges, np.arange(2, 200, dtype=np.int64), rest)))
    rng.shuffle(keys)
    keys = keys[:n]
    return np.concatenate((edges, keys[~np.isin(keys, edges)]))[:n]


def _applied_offsets(r: httpx.Response) -> dict[str, int]:
    """``updates.applied_offsets`` of a /v1/stats answer (an HTTPError for any other answer: a server starting)."""
    if r.status_code != 200 or "updates" not in r.json():
        raise httpx.HTTPError(f"/v1/stats answered {r.status_code}: {r.text[:200]}")
    return r.json()["updates"].get("applied_offsets", {})


class Workload:
    """Writers and readers against a primary (and optionally a replica), for a duration, recording into
    ``history`` (the primary's reads) and ``replica_reads``."""

    def __init__(self, server: HistoryServer, keys: np.ndarray, *, kafka_threads: int = 2, readers: int = 2,
                 local_readers: int = 1, import_every_s: float = 5.0, bulk_every_s: float = 1.0,
                 lull_every_s: float = 3.0, seed: int = 0) -> None:
        self.s = server
        self.keys = keys
        self.history = History()
        self.replica_reads: list[Read] = []
        self.replica: HistoryServer | None = None
        self.t0 = time.monotonic()
        self.kafka_threads = kafka_threads
        self.readers = readers
        self.local_readers = local_readers
        self.import_every_s = import_every_s
        self.bulk_every_s = bulk_every_s
        self.seed = seed
        self._stop = threading.Event()
        self._pending: list[tuple[Write, dict[tuple[str, int], int]]] = []
        self._pending_lock = threading.Lock()
        self.offsets: dict[int, dict[tuple[str, int], int]] = {}  # id(write) -> the offsets it must be applied past
        self.replica_acks: dict[int, float] = {}  # id(write) -> when the replica had applied it
        self.errors: list[str] = []
        #: Kafka calls that failed transiently (their writes stay unacknowledged, which the checker allows).
        self.kafka_hiccups: list[str] = []
        #: (server name, start, end) of each time a server was down; calls to it failing then are expected.
        self.outages: list[tuple[str, float, float]] = []
        self.failed_calls = 0
        #: REST writes acknowledged without going through the update topic (so no replica ever applies them).
        self.unlogged_writes: list[str] = []
        self._down: set[str] = set()
        self.lull_every_s = lull_every_s
        self.lulls = 0
        self._resume = threading.Event()  # cleared during a lull: writers wait before their next write
        self._resume.set()
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        # a skew: a quarter of the picks go to the first 5% of the keys (hot, cached), the rest spread out
        self._hot = max(8, keys.shape[0] // 20)
        self.reach = 1.0  # the share of the keys picked from (the first ones): a run may widen it midway

    # ---- outages ---------------------------------------------------------------------------------
    @contextmanager
    def outage(self, name: str):  # noqa: ANN201
        """Calls to server ``name`` may fail while this block runs (it kills and restarts it)."""
        start = time.monotonic()
        self._down.add(name)
        try:
            yield
        finally:
            self._down.discard(name)
            self.outages.append((name, start, time.monotonic()))

    def _tolerated(self, name: str, exc: BaseException, started: float) -> bool:
        """A call to ``name`` that began at ``started`` failed with ``exc``: expected when the server was down."""
        if not isinstance(exc, _DOWN_ERRORS):
            return False
        down = name in self._down or any(n == name and s - 1.0 <= started <= e + _RECONNECT_S
                                         for n, s, e in self.outages)
        self.failed_calls += down
        return down

    @contextmanager
    def _writing(self):  # noqa: ANN201
        """One write: waits while a lull holds the writers, counted while in flight."""
        while not self._resume.wait(0.1):
            if self._stop.is_set():
                break
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1

    def _lull(self, http: httpx.Client) -> Callable[[random.Random], None]:
        """Every ``lull_every_s`` or so: hold the writers until what they wrote is acknowledged, write keys read a
        moment ago once more (REST, applied), take a snapshot (a RocksDB checkpoint flushes every memtable) and read
        those keys through every reader (each worker over gRPC, the shared store) with no write after the flush:
        what a worker's RocksDB secondary answers then is what it kept from before the flush."""
        clients = [HPSClient(self.s.target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
        local_client = LocalClient(self.s.local_path, timeout=30)
        self._closing_lull = [*clients, local_client]
        path = f"/v1/models/{self.s.model}/tables/{self.s.table}/embeddings?wait=applied"

        def step(rng: random.Random) -> None:
            if self._stop.wait(self.lull_every_s * (0.5 + rng.random())) or self.s.name in self._down:
                return
            started = time.monotonic()
            self._resume.clear()
            try:
                deadline = time.monotonic() + 5
                while (self._in_flight or self.resolve_kafka_acks(http)) and time.monotonic() < deadline:
                    time.sleep(0.01)
                probe = self._pick(rng, 4 * VOLATILE_ROWS)  # more than the hash map holds: some are read from L3
                self._put_applied(http, path, probe)
                for client in clients:  # each worker's secondary replays these rows and holds them in a memtable
                    self.read(client, probe, via="lull-grpc")
                self._put_applied(http, path, probe)
                r = http.post(f"/v1/models/{self.s.model}/snapshots")
                if r.status_code != 201:
                    raise httpx.HTTPError(f"snapshot answered {r.status_code}: {r.text[:200]}")
                for _ in range(3):
                    for client, via in ((c, "lull-grpc") for c in clients):
                        self.read(client, probe, via=via)
                    self.read(local_client, probe, via="lull-local")
                self.lulls += 1
            except Exception as exc:
                if not self._tolerated(self.s.name, exc, started):
                    raise
            finally:
                self._resume.set()

        return step

    def _put_applied(self, http: httpx.Client, path: str, keys: np.ndarray) -> None:
        """A REST put of ``keys`` at a new version, answered once applied (acknowledged then)."""
        version = self.history.next_version()
        w = self.history.add_write(Write("put", keys, version, time.monotonic(), "rest"))
        r = http.put(path, json={"keys": keys.tolist(), "vectors": encode_rows(keys, version).tolist(),
                                 "version": version})
        if r.status_code != 200:
            raise httpx.HTTPError(f"REST write answered {r.status_code}: {r.text[:200]}")
        w.ack = time.monotonic()
        self.offsets[id(w)] = {(r.json()["topic"], int(p)): int(o) + 1 for p, o in r.json()["offsets"].items()}

    # ---- key picking -----------------------------------------------------------------------------
    def _pick(self, rng: random.Random, n: int) -> np.ndarray:
        reach = max(self._hot, int(self.reach * self.keys.shape[0]))
        hot = [rng.randrange(self._hot) for _ in range(n // 4)]
        cold = [rng.randrange(reach) for _ in range(n - len(hot))]
        return np.unique(self.keys[np.array(hot + cold, dtype=np.int64)])

    def _guard(self, fn: Callable[[random.Random], None], name: str, seed: int) -> threading.Thread:
        def run() -> None:
            rng = random.Random(seed)
            try:
                while not self._stop.is_set():
                    fn(rng)
            except Exception as exc:  # noqa: BLE001  (reported by the test)
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                self._stop.set()

        return threading.Thread(target=run, name=name, daemon=True)

    # ---- writers ---------------------------------------------------------------------------------
    def _kafka_writer(self, sizes: tuple[int, int], pause_s: float) -> Callable[[random.Random], None]:
        publisher = Publisher(self.s.broker, self.s.model)
        topic = publisher.topic
        probe = Consumer({"bootstrap.servers": self.s.broker, "group.id": f"{self.s.model}-probe"})

        def step(rng: random.Random) -> None:
            with self._writing():
                keys = self._pick(rng, rng.randint(*sizes))
                version = self.history.next_version()
                kind = "delete" if rng.random() < 0.15 else "put"
                w = self.history.add_write(Write(kind, keys, version, time.monotonic(), "kafka"))
                if kind == "put":
                    publisher.publish(self.s.table, keys, encode_rows(keys, version), version)
                else:
                    publisher.delete(self.s.table, keys, version)
                try:
                    publisher.flush(30)
                    ends = {}
                    for p in np.unique(partition_of(keys, publisher.partitions)).tolist():
                        ends[(topic, p)] = self._end_offset(probe, TopicPartition(topic, p))
                except KafkaException as exc:  # a busy broker: the write stays unacknowledged (it may still apply)
                    self.kafka_hiccups.append(f"{type(exc).__name__}: {exc}")
                    return
                self.offsets[id(w)] = ends
                with self._pending_lock:
                    self._pending.append((w, ends))
            self._stop.wait(rng.random() * pause_s)

        return step

    def _end_offset(self, probe: Consumer, tp: TopicPartition, attempts: int = 6) -> int:
        """The partition's end offset now, asked again while the broker times out."""
        for attempt in range(attempts):
            try:
                return int(probe.get_watermark_offsets(tp, timeout=10)[1])
            except KafkaException:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _rest_writer(self, http: httpx.Client) -> Callable[[random.Random], None]:
        # with Kafka on, REST writes go through the update topic; ?wait=applied answers once this server applied them
        path = f"/v1/models/{self.s.model}/tables/{self.s.table}/embeddings?wait=applied"

        def step(rng: random.Random) -> None:
            with self._writing():
                self._rest_write(http, path, rng)
            self._stop.wait(rng.random() * 0.03)

        return step

    def _rest_write(self, http: httpx.Client, path: str, rng: random.Random) -> None:
        keys = self._pick(rng, rng.randint(1, 16))
        started = time.monotonic()
        try:
            if rng.random() < 0.25:
                w = self.history.add_write(Write("admin_delete", keys, None, started, "rest"))
                r = http.request("DELETE", path, json={"keys": keys.tolist()})
            else:
                version = self.history.next_version()
                w = self.history.add_write(Write("put", keys, version, started, "rest"))
                r = http.put(path, json={"keys": keys.tolist(), "vectors": encode_rows(keys, version).tolist(),
                                         "version": version})
        except Exception as exc:
            if not self._tolerated(self.s.name, exc, started):
                raise
            self._stop.wait(0.2)
            return
        if r.status_code == 200:
            w.ack = time.monotonic()
            if "topic" not in r.json():  # applied here only: no replica gets it (reported by the test)
                self.unlogged_writes.append(f"{w.kind} v{w.version} of {keys.size} keys at "
                                            f"{started - self.t0:.3f}: {r.text[:100]}")
                return
            topic = r.json()["topic"]
            self.offsets[id(w)] = {(topic, int(p)): int(o) + 1 for p, o in r.json()["offsets"].items()}
        elif not (r.status_code >= 500 and self._tolerated(self.s.name, httpx.HTTPError(r.text), started)):
            raise AssertionError(f"REST write answered {r.status_code}: {r.text[:200]}")

    def _importer(self, http: httpx.Client) -> Callable[[random.Random], None]:
        def step(rng: random.Random) -> None:
            if self._stop.wait(self.import_every_s * (0.5 + rng.random())):
                return
            with self._writing():
                self._import(http, rng)

        return step

    def _import(self, http: httpx.Client, rng: random.Random) -> None:
        keys = self._pick(rng, 200)
        version = self.history.next_version()
        source = self.s.workdir / f"import-{version}.npz"
        np.savez(source, keys=keys, vectors=encode_rows(keys, version))
        started = time.monotonic()
        w = self.history.add_write(Write("put", keys, version, started, "import"))
        try:
            r = http.post(f"/v1/models/{self.s.model}/tables/{self.s.table}/import",
                          json={"path": str(source), "version": version})
            if r.status_code != 202:
                raise httpx.HTTPError(f"import answered {r.status_code}: {r.text[:200]}")
            job = r.json()["id"]
            while time.monotonic() - started < 120:
                got = http.get(f"/v1/jobs/{job}")
                if got.status_code != 200:  # the server restarted: the job died with it (unacknowledged)
                    raise httpx.HTTPError(f"job {job}: {got.status_code} {got.text[:200]}")
                state = got.json()["state"]
                if state == "succeeded":
                    w.ack = time.monotonic()
                    return
                assert state != "failed", got.json()
                time.sleep(0.02)
            raise AssertionError(f"import job {job} not done within 120 s")
        except Exception as exc:
            if not self._tolerated(self.s.name, exc, started):
                raise

    def _ack_tracker(self, http: httpx.Client) -> Callable[[random.Random], None]:
        def step(_rng: random.Random) -> None:
            started = time.monotonic()
            try:
                self.resolve_kafka_acks(http)
                if self.replica is not None and self.replica.name not in self._down:
                    self.resolve_replica_acks()
            except Exception as exc:
                if not (self._tolerated(self.s.name, exc, started)
                        or (self.replica is not None and self._tolerated(self.replica.name, exc, started))):
                    raise
            time.sleep(0.05)

        return step

    def resolve_kafka_acks(self, http: httpx.Client) -> int:
        """Acknowledge the Kafka writes the server has applied past (as of a /v1/stats read); returns how many
        are still pending."""
        applied = _applied_offsets(http.get("/v1/stats"))
        now = time.monotonic()  # after the answer: never earlier than the real apply
        with self._pending_lock:
            still = []
            for w, ends in self._pending:
                if all(applied.get(f"{t}[{p}]", -1) >= end for (t, p), end in ends.items()):
                    w.ack = now
                else:
                    still.append((w, ends))
            self._pending = still
            return len(still)

    def resolve_replica_acks(self) -> int:
        """Note when the replica had applied each write with known offsets; returns how many it has not."""
        assert self.replica is not None
        applied = _applied_offsets(httpx.get(f"{self.replica.http}/v1/stats", timeout=10))
        now = time.monotonic()
        left = 0
        for w in list(self.history.writes):
            ends = self.offsets.get(id(w))
            if ends is None or id(w) in self.replica_acks:
                continue
            if all(applied.get(f"{t}[{p}]", -1) >= end for (t, p), end in ends.items()):
                self.replica_acks[id(w)] = now
            else:
                left += 1
        return left

    # ---- readers ---------------------------------------------------------------------------------
    def _reader(self, client: HPSClient | LocalClient, via: str, server: HistoryServer) -> Callable[
            [random.Random], None]:
        def step(rng: random.Random) -> None:
            started = time.monotonic()
            try:
                if rng.random() < 0.5:
                    self.read(client, self._pick(rng, 32), via=via)
                else:
                    self.read_bags(client, self._pick(rng, 32), via=f"{via}-bags")
            except Exception as exc:
                if not self._tolerated(server.name, exc, started):
                    raise
                self._stop.wait(0.1)

        return step

    def read(self, client: HPSClient | LocalClient, keys: np.ndarray, via: str = "grpc") -> np.ndarray:
        """One recorded lookup; returns the versions shown (a replica's reads go to ``replica_reads``)."""
        start = time.monotonic()
        answer = client.lookup_with_sources(self.s.model, self.s.table, keys, timeout=30)
        return self._record(keys, answer.vectors, answer.sources, start, via)

    def read_bags(self, client: HPSClient | LocalClient, keys: np.ndarray, via: str) -> np.ndarray:
        """One recorded pooled lookup whose every bag reads as a plain read of one key: an empty bag first (a zero row,
        checked here), then bag ``i`` of ``keys[i]`` twice, pooled by mean (the row itself, exactly)."""
        start = time.monotonic()
        offsets = np.arange(-2, 2 * keys.shape[0], 2, dtype=np.int64).clip(0)
        answer = client.lookup_bags_many(self.s.model, {self.s.table: Bags(np.repeat(keys, 2), offsets, "mean")},
                                         timeout=30)[self.s.table]
        assert not answer.vectors[0].any() and answer.sources[0] == 0, "an empty bag answered other than a zero row"
        return self._record(keys, answer.vectors[1:], answer.sources[1:], start, via)

    def _record(self, keys: np.ndarray, rows: np.ndarray, sources: np.ndarray, start: float, via: str) -> np.ndarray:
        end = time.monotonic()
        sources = np.asarray(sources)
        shown = decode_rows(keys, rows, sources)
        read = Read(keys, shown, sources, start, end, via)
        if via.startswith("replica"):
            with self._pending_lock:
                self.replica_reads.append(read)
        else:
            self.history.add_read(read)
        return shown

    def replica_readers(self, replica: HistoryServer) -> list[threading.Thread]:
        """Readers of the replica (started once it is ready)."""
        client = HPSClient(replica.target)
        self._closing.append(client)
        threads = [self._guard(self._reader(client, "replica", replica), "replica-reader", self.seed + 500)]
        for t in threads:
            t.start()
        self._threads.extend(threads)
        return threads

    # ---- the run ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every writer and reader."""
        # no kept-alive connections: one kept from before a restart of the server fails whenever it is next used
        self._http = httpx.Client(base_url=self.s.http, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60,
                                  limits=httpx.Limits(max_keepalive_connections=0))
        clients: list[Any] = [HPSClient(self.s.target) for _ in range(self.readers)]
        local = [LocalClient(self.s.local_path, timeout=30) for _ in range(self.local_readers)]
        self._closing: list[Any] = [*clients, *local]
        small = [self._guard(self._kafka_writer((1, 24), 0.02), f"kafka-{i}", self.seed + i)
                 for i in range(self.kafka_threads)]
        bulk = [self._guard(self._kafka_writer((300, 1500), 2 * self.bulk_every_s), "kafka-bulk", self.seed + 50)]
        self._threads = [*small, *bulk,
                         self._guard(self._rest_writer(self._http), "rest", self.seed + 100),
                         self._guard(self._importer(self._http), "import", self.seed + 200),
                         self._guard(self._ack_tracker(self._http), "acks", self.seed + 300),
                         self._guard(self._lull(self._http), "lulls", self.seed + 350)]
        self._threads += [self._guard(self._reader(c, "grpc", self.s), f"reader-{i}", self.seed + 400 + i)
                          for i, c in enumerate(clients)]
        self._threads += [self._guard(self._reader(c, "local", self.s), f"local-reader-{i}", self.seed + 450 + i)
                          for i, c in enumerate(local)]
        for t in self._threads:
            t.start()

    def finish(self) -> None:
        """Stop writers and readers, then wait until every Kafka write is applied (acknowledged), by the replica
        too when there is one."""
        self._stop.set()
        for t in self._threads:
            t.join(120)
        deadline = time.monotonic() + 120
        while (left := self.resolve_kafka_acks(self._http)) or (
                self.replica is not None and (left := -self.resolve_replica_acks())):
            assert time.monotonic() < deadline, (
                f"{abs(left)} Kafka writes not applied by the {'replica' if left < 0 else 'primary'} within 120 s "
                f"after the run; errors: {self.errors}")
            time.sleep(0.05)
        for c in [*self._closing, *self._closing_lull]:
            c.close()
        self._http.close()

    def run(self, seconds: float) -> None:
        """Drive every writer and reader for ``seconds``, then :meth:`finish`."""
        self.start()
        self._stop.wait(seconds)
        self.finish()

    @property
    def stopped(self) -> threading.Event:
        return self._stop

    def final_passes(self, server: HistoryServer, via: str = "final") -> dict[str, np.ndarray]:
        """Writes stopped and applied: every key read with L1 as it is, then again after clearing L1 (answers from
        L2, or L3 where L2 lacks the key); both recorded as reads too."""
        passes = {}
        with HPSClient(server.target) as client, httpx.Client(
                base_url=server.http, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
            passes["L1 (the cache as left)"] = self.read(client, self.keys, via=via)
            http.post(f"/v1/cache/{self.s.model}/{self.s.table}/clear").raise_for_status()
            passes["L2 (after clearing L1)"] = self.read(client, self.keys, via=via)
        return passes

    def replica_history(self) -> History:
        """The history as the replica saw it: its reads; each write acknowledged when the replica had applied it
        (an import, which only the primary runs, never: its rows reach the replica only in a snapshot)."""
        h = History()
        for w in self.history.writes:
            h.writes.append(Write(w.kind, w.keys, w.version, w.start, w.via, self.replica_acks.get(id(w))))
        h.reads = list(self.replica_reads)
        return h
