"""Faults on the update path of a real `hps serve` process with a real broker and RocksDB:
the broker frozen while updates flow, the server SIGKILLed mid-ingest, RocksDB writes failing (file size limit)."""

from __future__ import annotations

import resource
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from confluent_kafka import Consumer, TopicPartition

from hps_service.client import HPSClient
from hps_service.engine import Source
from hps_service.errors import UnavailableError
from hps_service.tiers.rocksdb.tier import RocksDBTier
from hps_service.updates import Publisher
from hps_service.updates.message import decode_update, topic_name
from tests.faults.support import LookupLoad, readyz, rows_for, wait_for
from tests.helpers import ServerProcess, free_port, write_config

DIM = 16
PREFIX = "faults"
TOKEN = "fault-admin-token"


def _config(tmp_path: Path, brokers: str, model: str, group: str) -> tuple[Path, int, int]:
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / f"{group}.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "grace_period_s": 10},
        "cache": {"backend": "numpy", "capacity": 20_000, "warm_start": False},
        "volatile": {"type": "hashmap", "capacity_rows": 200_000},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "updates": {"type": "kafka", "brokers": brokers, "topic_prefix": PREFIX, "group": group},
        "models": [{"name": model, "tables": [{"name": "item", "dim": DIM}]}],
    })
    return cfg, grpc_port, http_port


def _put(http_port: int, model: str, keys: np.ndarray, version: int) -> None:
    """A REST put through the update topic, answered once this replica applied it."""
    r = httpx.put(f"http://127.0.0.1:{http_port}/v1/models/{model}/tables/item/embeddings?wait=applied",
                  json={"keys": keys.tolist(), "vectors": rows_for(keys, version, DIM).tolist(), "version": version},
                  headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text


def _served(client: HPSClient, model: str, keys: np.ndarray, version: int) -> bool:
    return bool(np.array_equal(client.lookup(model, "item", keys), rows_for(keys, version, DIM)))


def _update_stats(http_port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{http_port}/v1/stats", timeout=5).json()["updates"]


def _wait_ready(http_port: int, timeout: float = 30) -> None:
    wait_for(lambda: readyz(http_port)[0] == 200, timeout, "/readyz 200")


def test_broker_frozen_while_updates_flow(kafka_broker, tmp_path: Path) -> None:
    model = f"f{uuid.uuid4().hex[:8]}"
    cfg, grpc_port, http_port = _config(tmp_path, kafka_broker.bootstrap, model, "pause")
    updated = np.arange(1, 2001, dtype=np.int64)
    stable = np.arange(100_001, 102_001, dtype=np.int64)
    publisher = Publisher(kafka_broker.bootstrap, model, topic_prefix=PREFIX)
    acked: list[int] = []
    published: list[int] = []
    stop = threading.Event()

    def publish_steps() -> None:
        step = 1
        while not stop.is_set():
            step += 1
            publisher.publish("item", updated, rows_for(updated, step, DIM), step)
            published.append(step)
            try:
                publisher.flush(0.5)
                acked.append(step)
            except UnavailableError:
                pass  # not acknowledged yet (the broker is frozen); librdkafka keeps it queued
            time.sleep(0.05)

    with ServerProcess(cfg, grpc_port) as srv, HPSClient(srv.target) as client:
        _wait_ready(http_port)
        _put(http_port, model, stable, 1)
        load = LookupLoad(srv.target, model, "item", stable, lambda k: rows_for(k, 1, DIM)).start()
        writer = threading.Thread(target=publish_steps, daemon=True)
        try:
            writer.start()
            time.sleep(1.5)
            load.phase = "during"
            acked_before_pause = len(acked)
            kafka_broker.pause()
            try:
                time.sleep(3.0)
                status, _ = readyz(http_port)
            finally:
                kafka_broker.resume()
            load.phase = "after"
            time.sleep(1.5)
        finally:
            stop.set()
            writer.join(30)
            load.stop()
        publisher.flush(30)  # everything queued while frozen is acknowledged now: the latest step is the last sent
        last = published[-1]
        wait_for(lambda: _served(client, model, updated, last), 30, f"step {last} served")
        assert srv.stop() == 0
    publisher.close()
    print(f"\nbroker frozen 3 s: {len(published)} steps published, {len(acked)} acknowledged at once "
          f"({acked_before_pause} before the pause), the rest once resumed; latest "
          f"{last} served; lookups: {len(load.errors)} errors, {load.wrong_rows} wrong; {load.report()}; "
          f"/readyz while frozen: {status}")
    assert load.errors == [] and load.wrong_rows == 0
    assert load.latencies.get("during"), "lookups must have been served while the broker was frozen"
    assert acked_before_pause >= 1 and set(acked) <= set(published)


def _committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        consumer.close()


def _messages_below(bootstrap: str, topic: str, upto: dict[int, int]) -> list:
    """Decoded updates of every message below ``upto[partition]`` (the committed offsets)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False})
    wanted = {p: o for p, o in upto.items() if o > 0}
    consumer.assign([TopicPartition(topic, p, 0) for p in wanted])
    out, seen = [], {p: 0 for p in wanted}
    deadline = time.monotonic() + 30
    try:
        while any(seen[p] < o for p, o in wanted.items()) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            if msg.offset() < wanted[msg.partition()]:
                out.append(decode_update(msg.value()))
            seen[msg.partition()] = max(seen[msg.partition()], msg.offset() + 1)
    finally:
        consumer.close()
    assert all(seen[p] >= o for p, o in wanted.items()), f"could not read up to the committed offsets {wanted}"
    return out


def test_server_sigkilled_mid_ingest_loses_nothing(kafka_broker, tmp_path: Path) -> None:
    model = f"k{uuid.uuid4().hex[:8]}"
    group = "sigkill"
    cfg, grpc_port, http_port = _config(tmp_path, kafka_broker.bootstrap, model, group)
    publisher = Publisher(kafka_broker.bootstrap, model, topic_prefix=PREFIX)
    batches = 300
    stop = threading.Event()
    sent: list[int] = []

    def publish_batches() -> None:
        for step in range(1, batches + 1):  # each batch has its own keys, so a lost message shows
            keys = np.arange(step * 1000, step * 1000 + 1000, dtype=np.int64)
            publisher.publish("item", keys, rows_for(keys, step, DIM), step)
            sent.append(step)
            if stop.is_set():
                time.sleep(0.005)
        publisher.flush(60)

    srv = ServerProcess(cfg, grpc_port).start()
    writer = threading.Thread(target=publish_batches, daemon=True)
    writer.start()
    applied_at_kill = 0

    def applying() -> bool:
        nonlocal applied_at_kill
        applied_at_kill = httpx.get(f"http://127.0.0.1:{http_port}/v1/stats", timeout=5).json()["updates"].get(
            "rows_applied", 0)
        return applied_at_kill >= 20_000

    try:
        wait_for(applying, 60, "the server to be applying updates")
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGKILL)  # no drain, no final commit, RocksDB not closed
        srv.proc.wait(10)
    finally:
        stop.set()
        writer.join(120)
    assert not writer.is_alive() and len(sent) == batches
    topic = topic_name(model, PREFIX)
    committed = _committed_offsets(kafka_broker.bootstrap, group, topic, publisher.partitions)
    tier = RocksDBTier(path=tmp_path / "db", block_cache_mb=8)  # opens cleanly after the SIGKILL
    try:
        tier.create_table(f"{model}.item", DIM)
        missing = 0
        committed_rows = 0
        for upd in _messages_below(kafka_broker.bootstrap, topic, committed):
            got = tier.get(f"{model}.item", upd.keys)
            committed_rows += upd.keys.size
            missing += int(np.count_nonzero(~got.found | (got.versions < upd.versions)))
    finally:
        tier.close()
    assert committed_rows > 0, f"nothing committed before the kill: {committed}"
    assert missing == 0, f"{missing} rows of committed offsets are missing from RocksDB"
    all_keys = np.arange(1000, (batches + 1) * 1000, dtype=np.int64)
    expected = rows_for(all_keys, 0, DIM) + (all_keys // 1000).astype(np.float32)[:, None]
    # generous per-call timeout: the restarted server replays the uncommitted tail while these 50k-key lookups run
    with ServerProcess(cfg, grpc_port) as again, HPSClient(again.target, timeout=60) as client:

        def served(idx: np.ndarray) -> bool:
            got = np.concatenate([client.lookup(model, "item", all_keys[idx][i:i + 50_000])
                                  for i in range(0, idx.size, 50_000)])
            return bool(np.allclose(got, expected[idx], atol=1e-3))

        sample = np.arange(0, all_keys.size, 97)
        wait_for(lambda: served(sample), 120, "a sample of the published rows served after the restart", interval=0.5)
        wait_for(lambda: served(np.arange(all_keys.size)), 60, "every published row served after the restart",
                 interval=0.5)
        assert again.stop() == 0
    publisher.close()
    print(f"\nSIGKILL mid-ingest: {applied_at_kill} rows applied at the kill, {committed_rows} rows below the "
          f"committed offsets all in RocksDB, {all_keys.size} published rows all served after restart; lost: 0")


def test_rocksdb_write_failure_stops_commits_keeps_serving(kafka_broker, tmp_path: Path) -> None:
    model = f"r{uuid.uuid4().hex[:8]}"
    cfg, grpc_port, http_port = _config(tmp_path, kafka_broker.bootstrap, model, "rofail")
    stable = np.arange(1, 2001, dtype=np.int64)
    fresh = np.arange(50_001, 51_001, dtype=np.int64)
    publisher = Publisher(kafka_broker.bootstrap, model, topic_prefix=PREFIX)
    with ServerProcess(cfg, grpc_port) as srv, HPSClient(srv.target) as client:
        assert srv.proc is not None
        _wait_ready(http_port)
        publisher.publish("item", stable, rows_for(stable, 1, DIM), 1)
        publisher.flush(10)
        wait_for(lambda: _served(client, model, stable, 1), 30, "the first update served")
        load = LookupLoad(srv.target, model, "item", stable, lambda k: rows_for(k, 1, DIM)).start()
        try:
            time.sleep(0.5)
            load.phase = "during"
            # A "full volume" for the server process only: every append past 1 byte fails with EFBIG.
            resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
            publisher.publish("item", fresh, rows_for(fresh, 2, DIM), 2)
            publisher.flush(10)

            def not_ready_for_apply() -> bool:
                status, body = readyz(http_port)
                return status == 503 and any("cannot apply updates" in r for r in body.get("not_ready", []))

            wait_for(not_ready_for_apply, 30, "/readyz to report the failing writes")
            committed_then = _update_stats(http_port)["committed_offsets"]
            time.sleep(1.5)
            after = _update_stats(http_port)
            assert after["committed_offsets"] == committed_then, "offsets committed past unapplied updates"
            assert after["apply_failures"] > 0 and after["apply_error"]
            answer = client.lookup_with_sources(model, "item", fresh)
            assert set(answer.sources.tolist()) == {Source.DEFAULT}, "a failed write must not be served"
            status, body = readyz(http_port)
            resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        finally:
            load.stop()
        srv.stop()
    with ServerProcess(cfg, grpc_port) as again, HPSClient(again.target) as client:
        wait_for(lambda: _served(client, model, fresh, 2), 30, "the unapplied update replayed after restart")
        assert _served(client, model, stable, 1)
        assert again.stop() == 0
    publisher.close()
    print(f"\nRocksDB writes failing: /readyz {status} {body['not_ready']}; offsets held at {committed_then}; "
          f"lookups {load.requests}, errors {len(load.errors)}, wrong {load.wrong_rows}; {load.report()}; "
          f"replayed after restart, lost: 0")
    assert load.errors == [] and load.wrong_rows == 0 and load.latencies.get("during")
