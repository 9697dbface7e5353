"""SIGTERM while large lookups are in flight: the server refuses new work, finishes what it started, commits the
offsets of the updates it applied, closes RocksDB and exits 0 within server.grace_period_s."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, TopicPartition

from hps_service.client import HPSClient
from hps_service.errors import HPSError
from hps_service.tiers.rocksdb.tier import RocksDBTier
from hps_service.updates import Publisher
from hps_service.updates.message import topic_name
from tests.faults.support import readyz, rows_for, wait_for
from tests.helpers import ServerProcess, free_port, write_config

DIM = 64
ROWS = 50_000
GRACE_S = 15.0


def test_sigterm_drains_in_flight_lookups_and_commits(kafka_broker, tmp_path: Path) -> None:
    model = f"d{uuid.uuid4().hex[:8]}"
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "grace_period_s": GRACE_S},
        "cache": {"enabled": False},
        "volatile": {"type": "disabled"},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "updates": {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": "drain", "group": "drain"},
        "models": [{"name": model, "tables": [{"name": "item", "dim": DIM}]}],
    })
    keys = np.arange(1, ROWS + 1, dtype=np.int64)
    expected = rows_for(keys, 1, DIM)
    publisher = Publisher(kafka_broker.bootstrap, model, topic_prefix="drain")
    publisher.publish("item", keys, expected, 1)
    publisher.flush(30)
    srv = ServerProcess(cfg, grpc_port).start()
    assert srv.proc is not None
    outcomes: list[tuple[float, float, str]] = []  # (sent, finished, "ok" | "wrong" | error text)
    stop = threading.Event()

    def large_lookups() -> None:
        with HPSClient(srv.target, timeout=30, retries=0) as client:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    got = client.lookup(model, "item", keys)
                    outcome = "ok" if np.array_equal(got, expected) else "wrong"
                except HPSError as exc:
                    outcome = str(exc)
                outcomes.append((sent, time.monotonic(), outcome))
                if outcome != "ok" and outcome != "wrong":
                    return

    try:
        with HPSClient(srv.target) as client:
            wait_for(lambda: np.array_equal(client.lookup(model, "item", keys[-10:]), expected[-10:]), 60,
                     "the published rows served")
        assert readyz(http_port)[0] == 200
        workers = [threading.Thread(target=large_lookups, daemon=True) for _ in range(3)]
        for w in workers:
            w.start()
        wait_for(lambda: len(outcomes) >= 3, 60, "a few large lookups answered")
        sigterm_at = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(GRACE_S + 10)
        exited_after = time.monotonic() - sigterm_at
        stop.set()
        for w in workers:
            w.join(30)
    finally:
        srv.stop()
    # Sent well before the signal, so the server had it before it began to drain (a request sent in the last
    # moments may reach a server already refusing work: UNAVAILABLE or CANCELLED, which is a refusal, not a drop).
    in_flight = [o for o in outcomes if o[0] < sigterm_at - 0.02 and o[1] > sigterm_at]
    failed_in_flight = [o for o in in_flight if o[2] != "ok" and "draining" not in o[2]]
    drained = [o for o in in_flight if o[2] == "ok"]
    print(f"\nSIGTERM: exit {code} after {exited_after:.2f} s (grace {GRACE_S} s); {len(outcomes)} lookups of "
          f"{ROWS} keys, {len(in_flight)} in flight at SIGTERM, {len(drained)} of them completed, "
          f"{len(failed_in_flight)} failed; after: {sorted({o[2][:60] for o in outcomes if o[0] > sigterm_at})}")
    assert code == 0 and exited_after < GRACE_S
    assert not any(o[2] == "wrong" for o in outcomes)
    assert failed_in_flight == [] and drained, "in-flight lookups must complete"
    topic = topic_name(model, "drain")
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "drain"})
    try:
        tps = [TopicPartition(topic, p) for p in range(publisher.partitions)]
        committed = {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in tps}
    finally:
        consumer.close()
    assert all(committed[p] == ends[p] for p in ends if ends[p] > 0), (committed, ends)
    publisher.close()
    tier = RocksDBTier(path=tmp_path / "db", block_cache_mb=8)
    try:
        tier.create_table(f"{model}.item", DIM)
        assert tier.get(f"{model}.item", keys).found.all()
    finally:
        tier.close()
