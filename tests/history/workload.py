"""A concurrent workload against a running ``hps serve`` that records a :class:`History` (see :mod:`model`).

Writers: Kafka puts and tombstones from :class:`Publisher` threads (acknowledged once the server's consumer has
applied past the offsets the topic had when ``flush()`` returned, as ``/v1/stats`` reports), REST puts and admin
deletes (acknowledged by the response), and REST import jobs (acknowledged once the job succeeded). Readers: gRPC
lookups. Keys come from a small space with the int64 edges and a skew, so with a small L1 and a small hash map
admission, eviction and promotion run all the time. Reusable against any server (``server.workers: 2`` included):
give it the targets.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from confluent_kafka import Consumer, KafkaException, TopicPartition

from hps_service.client import HPSClient
from hps_service.updates import Publisher
from hps_service.updates.partitioning import partition_of
from tests.helpers import REPO, free_port, wait_serving
from tests.history.model import DEFAULT, DEFAULT_VALUE, DIM, History, Read, Violation, Write, decode_rows, encode_rows

TOKEN = "history-token"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def key_space(n: int, seed: int = 14) -> np.ndarray:
    """``n`` distinct keys: the int64 edges, small ones, and random ones over the whole range."""
    rng = np.random.default_rng(seed)
    edges = np.array([INT64_MIN, INT64_MIN + 1, -1, 0, 1, INT64_MAX - 1, INT64_MAX], dtype=np.int64)
    rest = rng.integers(INT64_MIN, INT64_MAX, size=n * 2, dtype=np.int64, endpoint=True)
    keys = np.unique(np.concatenate((edges, np.arange(2, 200, dtype=np.int64), rest)))
    rng.shuffle(keys)
    keys = keys[:n]
    return np.concatenate((edges, keys[~np.isin(keys, edges)]))[:n]


@dataclass
class HistoryServer:
    """``hps serve`` for the checker: small L1 and hash map, RocksDB, Kafka updates; its log goes to a file (a pipe
    nobody reads would block it)."""

    workdir: Path
    broker: str
    model: str = "hist"
    table: str = "t"
    overrides: dict[str, Any] = field(default_factory=dict)
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def db(self) -> Path:
        return self.workdir / "db"

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "server": {"grpc_port": self.grpc_port, "http_port": self.http_port, "admin_token": TOKEN,
                       "max_batch_keys": 4096, "grace_period_s": 10},
            "cache": {"backend": "numpy", "capacity": 256, "ways": 8},
            "volatile": {"type": "hashmap", "capacity_rows": 600},
            "persistent": {"type": "rocksdb", "path": str(self.db), "block_cache_mb": 8},
            "updates": {"type": "kafka", "brokers": self.broker, "group": f"{self.model}-history"},
            "models": [{"name": self.model, "tables": [{"name": self.table, "dim": DIM,
                                                         "default": {"constant": DEFAULT_VALUE}}]}],
        }
        for section, values in self.overrides.items():
            cfg.setdefault(section, {}).update(values)
        return cfg

    def start(self, timeout: float = 300.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "config.yaml"
        path.write_text(yaml.safe_dump(self.config()))
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115  (owned by the child process)
        self.proc = subprocess.Popen([sys.executable, "-m", "hps_service.cli", "serve", "--config", str(path)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ))
        log.close()
        wait_serving(self.target, timeout, self.proc)
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.http}/readyz", timeout=5).status_code != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.1)

    def stop(self) -> int:
        from hps_service.local_processes import stop_process

        assert self.proc is not None
        return stop_process(self.proc, 60)


class Workload:
    """Writers and readers against one server, for a duration, recording into ``history``."""

    def __init__(self, server: HistoryServer, keys: np.ndarray, *, kafka_threads: int = 2, readers: int = 2,
                 import_every_s: float = 5.0, seed: int = 0) -> None:
        self.s = server
        self.keys = keys
        self.history = History()
        self.t0 = time.monotonic()
        self.kafka_threads = kafka_threads
        self.readers = readers
        self.import_every_s = import_every_s
        self.seed = seed
        self._stop = threading.Event()
        self._pending: list[tuple[Write, dict[tuple[str, int], int]]] = []
        self._pending_lock = threading.Lock()
        self.errors: list[str] = []
        #: Kafka calls that failed transiently (their writes stay unacknowledged, which the checker allows).
        self.kafka_hiccups: list[str] = []
        # a skew: a quarter of the picks go to the first 5% of the keys (hot, cached), the rest spread out
        self._hot = max(8, keys.shape[0] // 20)

    # ---- key picking -----------------------------------------------------------------------------
    def _pick(self, rng: random.Random, n: int) -> np.ndarray:
        hot = [rng.randrange(self._hot) for _ in range(n // 4)]
        cold = [rng.randrange(self.keys.shape[0]) for _ in range(n - len(hot))]
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
    def _kafka_writer(self) -> Callable[[random.Random], None]:
        publisher = Publisher(self.s.broker, self.s.model)
        topic = publisher.topic
        probe = Consumer({"bootstrap.servers": self.s.broker, "group.id": f"{self.s.model}-probe"})

        def step(rng: random.Random) -> None:
            keys = self._pick(rng, rng.randint(1, 24))
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
            with self._pending_lock:
                self._pending.append((w, ends))
            time.sleep(rng.random() * 0.02)

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
            keys = self._pick(rng, rng.randint(1, 16))
            if rng.random() < 0.25:
                w = self.history.add_write(Write("admin_delete", keys, None, time.monotonic(), "rest"))
                r = http.request("DELETE", path, json={"keys": keys.tolist()})
            else:
                version = self.history.next_version()
                w = self.history.add_write(Write("put", keys, version, time.monotonic(), "rest"))
                r = http.put(path, json={"keys": keys.tolist(), "vectors": encode_rows(keys, version).tolist(),
                                         "version": version})
            if r.status_code == 200:
                w.ack = time.monotonic()
            else:
                raise AssertionError(f"REST write answered {r.status_code}: {r.text[:200]}")
            time.sleep(rng.random() * 0.03)

        return step

    def _importer(self, http: httpx.Client) -> Callable[[random.Random], None]:
        def step(rng: random.Random) -> None:
            if self._stop.wait(self.import_every_s * (0.5 + rng.random())):
                return
            keys = self._pick(rng, 200)
            version = self.history.next_version()
            source = self.s.workdir / f"import-{version}.npz"
            np.savez(source, keys=keys, vectors=encode_rows(keys, version))
            w = self.history.add_write(Write("put", keys, version, time.monotonic(), "import"))
            r = http.post(f"/v1/models/{self.s.model}/tables/{self.s.table}/import",
                          json={"path": str(source), "version": version})
            assert r.status_code == 202, r.text[:200]
            job = r.json()["id"]
            while True:
                state = http.get(f"/v1/jobs/{job}").json()["state"]
                if state == "succeeded":
                    w.ack = time.monotonic()
                    return
                assert state != "failed", http.get(f"/v1/jobs/{job}").json()
                time.sleep(0.02)

        return step

    def _ack_tracker(self, http: httpx.Client) -> Callable[[random.Random], None]:
        def step(_rng: random.Random) -> None:
            self.resolve_kafka_acks(http)
            time.sleep(0.05)

        return step

    def resolve_kafka_acks(self, http: httpx.Client) -> int:
        """Acknowledge the Kafka writes the server has applied past (as of a /v1/stats read); returns how many
        are still pending."""
        applied = http.get("/v1/stats").json()["updates"].get("applied_offsets", {})
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

    # ---- readers ---------------------------------------------------------------------------------
    def _reader(self, client: HPSClient) -> Callable[[random.Random], None]:
        def step(rng: random.Random) -> None:
            self.read(client, self._pick(rng, 32))

        return step

    def read(self, client: HPSClient, keys: np.ndarray, via: str = "grpc") -> np.ndarray:
        """One recorded lookup; returns the versions shown."""
        start = time.monotonic()
        answer = client.lookup_with_sources(self.s.model, self.s.table, keys, timeout=30)
        end = time.monotonic()
        shown = decode_rows(keys, answer.vectors, answer.sources)
        self.history.add_read(Read(keys, shown, np.asarray(answer.sources), start, end, via))
        return shown

    # ---- the run ---------------------------------------------------------------------------------
    def run(self, seconds: float) -> None:
        """Drive every writer and reader for ``seconds``, then stop them and wait until every Kafka write is
        applied (acknowledged)."""
        http = httpx.Client(base_url=self.s.http, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        clients = [HPSClient(self.s.target) for _ in range(self.readers)]
        threads = [self._guard(self._kafka_writer(), f"kafka-{i}", self.seed + i) for i in range(self.kafka_threads)]
        threads += [self._guard(self._rest_writer(http), "rest", self.seed + 100),
                    self._guard(self._importer(http), "import", self.seed + 200),
                    self._guard(self._ack_tracker(http), "acks", self.seed + 300)]
        threads += [self._guard(self._reader(c), f"reader-{i}", self.seed + 400 + i) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        self._stop.wait(seconds)
        self._stop.set()
        for t in threads:
            t.join(120)
        deadline = time.monotonic() + 120
        while self.resolve_kafka_acks(http):
            assert time.monotonic() < deadline, "Kafka writes not applied within 120 s after the run"
            time.sleep(0.05)
        for c in clients:
            c.close()
        http.close()

    def final_passes(self) -> dict[str, np.ndarray]:
        """Writes stopped and applied: every key read with L1 as it is, then again after clearing L1 (answers from
        L2, or L3 where L2 lacks the key); both recorded as reads too."""
        passes = {}
        with HPSClient(self.s.target) as client, httpx.Client(
                base_url=self.s.http, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
            passes["L1 (the cache as left)"] = self.read(client, self.keys, via="final")
            http.post(f"/v1/cache/{self.s.model}/{self.s.table}/clear").raise_for_status()
            passes["L2 (after clearing L1)"] = self.read(client, self.keys, via="final")
        return passes

    def topic_log(self, keys: np.ndarray, timeout: float = 30.0) -> str:
        """Every message of the update topic that touches ``keys``, in partition and offset order, for a violation
        report: what the broker holds is the other half of the story (was the acknowledged write ever there?)."""
        from hps_service.updates.message import decode_update, topic_name

        topic = topic_name(self.s.model)
        consumer = Consumer({"bootstrap.servers": self.s.broker, "group.id": f"{self.s.model}-dump",
                             "enable.auto.commit": False})
        lines: list[tuple[int, int, str]] = []
        try:
            meta = consumer.list_topics(topic, timeout=timeout).topics[topic]
            parts = sorted(meta.partitions)
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1] for p in parts}
            consumer.assign([TopicPartition(topic, p, 0) for p in parts if ends[p] > 0])
            left = {p for p in parts if ends[p] > 0}
            deadline = time.monotonic() + timeout
            while left and time.monotonic() < deadline:
                for msg in consumer.consume(1000, 1.0):
                    if msg.error() is not None:
                        continue
                    if msg.offset() >= ends[msg.partition()] - 1:
                        left.discard(msg.partition())
                    upd = decode_update(msg.value())
                    for kind, ks, vs in (("put", upd.keys, upd.versions), ("delete", upd.delete_keys,
                                                                           upd.delete_versions)):
                        for i in np.flatnonzero(np.isin(ks, keys)):
                            lines.append((msg.partition(), msg.offset(),
                                          f"  [{msg.partition()}]@{msg.offset()} key {int(ks[i])} {kind} "
                                          f"v{int(vs[i])}"))
                    if upd.purge_tombstones_below:
                        lines.append((msg.partition(), msg.offset(), f"  [{msg.partition()}]@{msg.offset()} purge "
                                                                     f"below v{upd.purge_tombstones_below}"))
        finally:
            consumer.close()
        return "\n".join(text for _, _, text in sorted(lines))

    def stored_versions(self) -> np.ndarray:
        """What RocksDB holds for every key (the server stopped): the row's version, or DEFAULT."""
        from hps_service.tiers.rocksdb import RocksDBTier

        store = RocksDBTier(self.s.db, read_only=True)
        try:
            got = store.get(f"{self.s.model}.{self.s.table}", self.keys)
        finally:
            store.close()
        shown = decode_rows(self.keys, got.vectors, np.where(got.found, 3, 4))
        return np.where(got.found, shown, DEFAULT)


def report(history: History, violations: list[Violation], t0: float, limit: int = 10) -> str:
    """Operation counts and the first ``limit`` violations, each with its key's history."""
    from tests.history.model import key_history

    counts = history.counts()
    lines = [f"history: {counts['operations']} operations ("
             + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "operations")
             + f"); {len(violations)} violations"]
    for v in violations[:limit]:
        when = "" if v.at is None else f" (lookup at {v.at - t0:.3f})"
        lines.append(f"VIOLATION key {v.key}: {v.rule}: {v.detail}{when}")
        lines.append(key_history(history, v.key, t0, at=v.at))
    return "\n".join(lines)
