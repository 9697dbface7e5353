"""Online-update ingest and freshness against a real tansu broker, while another thread serves lookups.

Run: ``python -m loadtest.benchmarks.updates --rows 200000 --dim 64``. In one run, side by side:
  1. raw: a bare confluent-kafka consumer draining a pre-filled topic and parsing each message (the floor a
     consumer cannot beat on this broker) vs the UpdateConsumer draining the same log into the engine
     (RocksDB synced writes -> hash map -> L1); both while a lookup thread runs; prints the ratio.
  2. freshness: publish() of a small batch -> the rows served by engine.lookup, p50/p99, next to the broker's
     own produce -> consume latency measured the same way (target: p99 under 100 ms).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from hps_service.config import HPSConfig, ModelConfig, TableConfig, UpdatesConfig
from hps_service.engine import LookupEngine
from hps_service.serve.process import build_engine
from hps_service.updates import Publisher, UpdateConsumer
from hps_service.updates.consumer import _CONSUMER_DEFAULTS
from hps_service.updates.message import decode_update, rows_per_message
from loadtest.harness import cli
from loadtest.harness.plan import Plan

TABLE = "item"


def rows_for(keys: np.ndarray, version: int, dim: int) -> np.ndarray:
    """Rows that encode (key, version), so a served row tells which write it came from."""
    base = (keys.astype(np.float64) * 1e-3 + version).astype(np.float32)
    return base[:, None] + np.arange(dim, dtype=np.float32)[None, :] * np.float32(1e-4)


class LookupLoad:
    """A thread that keeps calling engine.lookup on random batches of known keys and counts keys served."""

    def __init__(self, engine: LookupEngine, model: str, key_space: int, batch: int) -> None:
        self.engine, self.model, self.key_space, self.batch = engine, model, key_space, batch
        self.keys_served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = np.random.default_rng(1)
        while not self._stop.is_set():
            keys = rng.integers(0, self.key_space, self.batch, dtype=np.int64)
            self.engine.lookup(self.model, TABLE, keys)
            self.keys_served += self.batch

    @contextmanager
    def running(self) -> Iterator[LookupLoad]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def raw_drain(brokers: str, topic: str, partitions: int, rows: int, batch: int) -> float:
    """Seconds for a bare consumer (same fetch settings, assign from the beginning) to read and parse ``rows``."""
    conf = {k: v for k, v in _CONSUMER_DEFAULTS.items()}
    c = Consumer({**conf, "bootstrap.servers": brokers, "group.id": f"raw-{uuid.uuid4().hex[:6]}"})
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    seen = 0
    t0 = time.perf_counter()
    while seen < rows:
        for m in c.consume(num_messages=batch, timeout=0.05):
            if m.error() is None:
                seen += decode_update(m.value()).keys.shape[0]
    elapsed = time.perf_counter() - t0
    c.close()
    return elapsed


def consumer_drain(cfg: UpdatesConfig, engine: LookupEngine, model: str, rows: int, batch: int, group: str) -> float:
    """Seconds from ready until a new UpdateConsumer group has applied ``rows`` to the engine."""
    consumer = UpdateConsumer(cfg, engine, [model], group, batch_messages=batch)
    consumer.start()
    consumer.wait_ready(30)
    t0 = time.perf_counter()
    while consumer.metrics.rows_received < rows:
        time.sleep(0.001)
    elapsed = time.perf_counter() - t0
    consumer.stop()
    return elapsed


def engine_alone(engine: LookupEngine, model: str, keys: np.ndarray, dim: int) -> float:
    """Seconds for engine.apply_updates to write ``keys`` again (version 2), one message's worth of rows per call."""
    step = rows_per_message(dim)
    t0 = time.perf_counter()
    for lo in range(0, keys.shape[0], step):
        k = keys[lo : lo + step]
        engine.apply_updates(model, TABLE, k, rows_for(k, 2, dim), np.full(k.shape[0], 2, dtype=np.int64))
    return time.perf_counter() - t0


def broker_latency(brokers: str, model: str, samples: int, keys: int, dim: int) -> np.ndarray:
    """publish() -> a bare consumer receives it, per sample (seconds): the broker's own floor."""
    pub = Publisher(brokers, model)
    c = Consumer({**_CONSUMER_DEFAULTS, "bootstrap.servers": brokers, "group.id": "lat"})
    c.assign([TopicPartition(pub.topic, p, OFFSET_BEGINNING) for p in range(pub.partitions)])
    out = []
    rng = np.random.default_rng(3)
    for i in range(samples):
        k = rng.integers(0, 1 << 40, keys, dtype=np.int64)
        t0 = time.perf_counter()
        sent = pub.publish(TABLE, k, rows_for(k, i, dim), i)
        got = 0
        while got < sent:
            got += sum(1 for m in c.consume(num_messages=100, timeout=0.001) if m.error() is None)
        out.append(time.perf_counter() - t0)
        time.sleep(rng.uniform(0.005, 0.02))
    c.close()
    pub.flush()
    return np.asarray(out)


def freshness(pub: Publisher, engine: LookupEngine, model: str, key_space: int, samples: int, keys: int,
              dim: int) -> tuple[np.ndarray, int]:
    """publish() -> every published row served by engine.lookup, per sample (seconds); and samples over 5 s."""
    rng = np.random.default_rng(2)
    out, missed = [], 0
    for i in range(samples):
        k = np.unique(rng.integers(0, key_space, keys, dtype=np.int64))
        version = 1_000_000 + i
        want = rows_for(k, version, dim)
        t0 = time.perf_counter()
        pub.publish(TABLE, k, want, version)
        deadline = t0 + 5.0
        while not np.array_equal(engine.lookup(model, TABLE, k).vectors, want):
            if time.perf_counter() > deadline:
                missed += 1
                break
            time.sleep(0.0005)
        else:
            out.append(time.perf_counter() - t0)
        time.sleep(rng.uniform(0.005, 0.02))
    pub.flush()
    return np.asarray(out), missed


def pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) * 1e3 if a.size else float("nan")


def part(p: Plan) -> dict[str, Any]:
    """Part 6 of ``make bench``: this module as a subprocess (reported as not run if it fails); its printed freshness
    lines parsed."""
    cmd = [sys.executable, "-m", __spec__.name, "--rows", "50000", "--samples", str(p.freshness_samples)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, cwd=cli.REPO)
    except subprocess.TimeoutExpired:
        return {"run": False, "reason": f"{__spec__.name} did not finish within 300 s"}
    if proc.returncode != 0:
        return {"run": False, "reason": f"{__spec__.name} exited {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    text = proc.stdout
    match = re.search(r"served by engine\.lookup p50 ([\d.]+) ms, p99 ([\d.]+) ms", text)
    lookups = re.search(r"lookups ([\d,]+) keys/s meanwhile", text)
    return {"run": True, "p50_ms": float(match.group(1)) if match else None,
            "p99_ms": float(match.group(2)) if match else None,
            "lookup_keys_per_s_meanwhile": float(lookups.group(1).replace(",", "")) if lookups else None,
            "target_p99_ms": 1000.0, "output": text.strip().splitlines()}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=5_000, help="rows per publish() call when pre-filling")
    parser.add_argument("--batch-messages", type=int, default=1000, help="consume(num_messages=...)")
    parser.add_argument("--lookup-batch", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=200, help="freshness samples")
    parser.add_argument("--sample-keys", type=int, default=256, help="rows per freshness publish")
    parser.add_argument("--brokers", default=None, help="an existing broker; default: start tansu")
    args = parser.parse_args(argv)

    if args.brokers:
        broker_ctx = nullcontext(args.brokers)
    else:
        from hps_service.updates.local_broker import running_tansu

        broker_ctx = running_tansu()
    with broker_ctx as broker, tempfile.TemporaryDirectory() as tmp:
        brokers = broker if isinstance(broker, str) else broker.bootstrap
        model = f"bench{uuid.uuid4().hex[:6]}"
        config = HPSConfig(
            cache={"backend": "numpy", "capacity": 0.2, "warm_start": False},
            volatile={"type": "hashmap", "capacity_rows": args.rows * 2},
            persistent={"type": "rocksdb", "path": f"{tmp}/db"},
            models=[ModelConfig(name=model, tables=[TableConfig(name=TABLE, dim=args.dim)])],
        )
        engine = build_engine(config)
        cfg = UpdatesConfig(type="kafka", brokers=brokers)
        pub = Publisher(brokers, model, partitions=args.partitions)
        keys = np.arange(args.rows, dtype=np.int64)
        t0 = time.perf_counter()
        for lo in range(0, args.rows, args.chunk):
            k = keys[lo : lo + args.chunk]
            pub.publish(TABLE, k, rows_for(k, 1, args.dim), 1)
        pub.flush()
        t_publish = time.perf_counter() - t0
        print(f"broker {brokers}, {args.partitions} partitions; {args.rows} rows x dim {args.dim} "
              f"({pub.messages_sent} messages); publish+flush {args.rows / t_publish:,.0f} rows/s")

        load = LookupLoad(engine, model, args.rows, args.lookup_batch)
        with load.running():
            while load.keys_served < 20 * args.lookup_batch:  # past the first calls (numba compiles kernels)
                time.sleep(0.05)
            k0 = load.keys_served
            t_raw = raw_drain(brokers, pub.topic, pub.partitions, args.rows, args.batch_messages)
            k1 = load.keys_served
            group = f"apply-{uuid.uuid4().hex[:6]}"
            t_apply = consumer_drain(cfg, engine, model, args.rows, args.batch_messages, group)
            k2 = load.keys_served
            t_engine = engine_alone(engine, model, keys, args.dim)
            raw_rate, apply_rate = args.rows / t_raw, args.rows / t_apply
            print(f"ingest under lookup load: raw consume+parse {raw_rate:,.0f} rows/s "
                  f"(lookups {(k1 - k0) / t_raw:,.0f} keys/s), UpdateConsumer -> engine {apply_rate:,.0f} rows/s "
                  f"(lookups {(k2 - k1) / t_apply:,.0f} keys/s); ratio applied/raw {apply_rate / raw_rate:.2f}")
            print(f"  engine.apply_updates alone, one message's rows per call: {args.rows / t_engine:,.0f} rows/s "
                  f"(RocksDB synced versioned put -> hash map -> L1)")

            floor = broker_latency(brokers, f"{model}lat", args.samples, args.sample_keys, args.dim)
            consumer = UpdateConsumer(cfg, engine, [model], group)  # resumes where the drain committed
            consumer.start()
            consumer.wait_ready(30)
            k3, t3 = load.keys_served, time.perf_counter()
            fresh, missed = freshness(pub, engine, model, args.rows, args.samples, args.sample_keys, args.dim)
            lookups = (load.keys_served - k3) / (time.perf_counter() - t3)
            lag = consumer.metrics.lag_percentiles((50, 99))
            consumer.stop()
        print(f"freshness, {args.samples} publishes of {args.sample_keys} rows, lookups {lookups:,.0f} keys/s "
              f"meanwhile: publish() -> served by engine.lookup p50 {pct(fresh, 50):.1f} ms, "
              f"p99 {pct(fresh, 99):.1f} ms, max {pct(fresh, 100):.1f} ms, over 5 s: {missed}")
        print(f"  broker floor publish() -> bare consumer: p50 {pct(floor, 50):.1f} ms, p99 {pct(floor, 99):.1f} ms;"
              f" ratio p50 {pct(fresh, 50) / pct(floor, 50):.2f}x, p99 {pct(fresh, 99) / pct(floor, 99):.2f}x")
        print(f"  consumer's own end-to-end lag (producer timestamp -> applied): p50 {lag['p50'] * 1e3:.1f} ms, p99 {lag['p99'] * 1e3:.1f} ms")
        engine.close()
    return 0


if __name__ == "__main__":
    cli.run(main)
