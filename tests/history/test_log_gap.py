"""The history checker's log-gap edge (issue 27): a replica stopped, its update topic deleted and created again, more
updates written to the new log than the replica had applied of the old one, the replica started again on its volume.
Its stored positions then point into the new log, past updates it never applied: it must end up not ready (naming the
topic), never ready and serving rows that miss those updates (since issue 27 part B and issue 32 it also refuses
lookups, UNAVAILABLE, until bootstrapped again). Every read answered is checked as the history checker checks,
against what the replica acknowledged (its applied offsets)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from hps_service.client import HPSClient
from hps_service.errors import UnavailableError
from hps_service.updates import Publisher
from hps_service.updates.message import topic_name
from tests.history.model import History, Read, Write, check, decode_rows, encode_rows
from tests.history.report import report
from tests.history.server import HistoryServer

PARTITIONS = 2


class LogGap:
    """Writes to the topic, each acknowledged once the replica applied past it, and reads from the replica."""

    def __init__(self, broker: str, server: HistoryServer) -> None:
        self.server = server
        self.topic = topic_name(server.model)
        self.history = History()
        self.ends: dict[int, dict[int, int]] = {}  # id(write) -> partition -> end offset it must be applied past
        self._probe = Consumer({"bootstrap.servers": broker, "group.id": f"{server.model}-probe"})
        self._broker = broker

    def publish(self, batches: list[np.ndarray]) -> None:
        """One put of each batch of keys, each a message of its own in each partition its keys fall in."""
        with Publisher(self._broker, self.server.model, partitions=PARTITIONS) as pub:
            for keys in batches:
                version = self.history.next_version()
                w = self.history.add_write(Write("put", keys, version, time.monotonic(), "kafka"))
                pub.publish(self.server.table, keys, encode_rows(keys, version), version)
                pub.flush(30)
                self.ends[id(w)] = {p: int(self._probe.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=10)[1]) for p in range(PARTITIONS)}

    def acknowledge(self) -> int:
        """Acknowledge what the replica applied past; returns how many writes it has not."""
        applied = httpx.get(f"{self.server.http}/v1/stats", timeout=10).json()["updates"].get("applied_offsets", {})
        now, left = time.monotonic(), 0
        for w in self.history.writes:
            if w.ack is None:
                if all(applied.get(f"{self.topic}[{p}]", -1) >= end for p, end in self.ends[id(w)].items()):
                    w.ack = now
                else:
                    left += 1
        return left

    def read(self, keys: np.ndarray) -> np.ndarray | None:
        """The replica's rows of ``keys`` (checked later), or None when it refuses the call (UNAVAILABLE: a replica
        whose partitions lost updates takes itself out of the clients' rotation)."""
        start = time.monotonic()
        try:
            with HPSClient(self.server.target) as client:
                answer = client.lookup_with_sources(self.server.model, self.server.table, keys, timeout=30)
        except UnavailableError:
            return None
        shown = decode_rows(keys, answer.vectors, np.asarray(answer.sources))
        self.history.add_read(Read(keys, shown, np.asarray(answer.sources), start, time.monotonic()))
        return shown

    def close(self) -> None:
        self._probe.close()


@pytest.mark.long  # ~35 s (two starts of a replica); make test covers the loss in tests/{updates,fleet}/test_lost_updates.py
@pytest.mark.timeout(300)
def test_a_recreated_topic_ends_in_not_ready_never_in_rows_missing_updates(kafka_broker, tmp_path: Path) -> None:
    model = f"g{uuid.uuid4().hex[:10]}"
    server = HistoryServer(tmp_path, kafka_broker.bootstrap, model=model, name="replica", overrides={
        "server": {"workers": 0, "local": {"enabled": False}}, "cluster": {"partitions": PARTITIONS}})
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    topic = topic_name(model)
    [f.result(30) for f in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values()]
    gap = LogGap(kafka_broker.bootstrap, server)
    old, lost, kept = (np.arange(lo, lo + 16, dtype=np.int64) for lo in (1000, 2000, 3000))
    server.start()
    try:
        gap.publish([old] * 6)  # the old log: six updates of every partition
        deadline = time.monotonic() + 60
        while gap.acknowledge():
            assert time.monotonic() < deadline, "the replica never applied the old log"
            time.sleep(0.05)
        assert server.stop() == 0
        [f.result(30) for f in admin.delete_topics([topic]).values()]
        time.sleep(1)
        [f.result(30) for f in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values()]
        # the new log: its first six updates (keys of their own) lie below the positions the replica stored
        gap.publish([lost + 100 * i for i in range(6)] + [kept] * 6)
        server.launch()
        deadline = time.monotonic() + 120
        while server.readyz()[0] == 0:
            assert server.proc is not None and server.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        deadline = time.monotonic() + 3  # long enough to catch up, or to find the gap
        status, body = server.readyz()
        while not any(topic in r for r in body.get("not_ready", [])) and time.monotonic() < deadline:
            time.sleep(0.05)
            status, body = server.readyz()
        gap.acknowledge()
        shown = gap.read(np.concatenate([lost + 100 * i for i in range(6)] + [kept, old]))
    finally:
        gap.close()
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
    violations = check(gap.history)
    served = "refused (UNAVAILABLE)" if shown is None else "answered"
    print(f"/readyz {status}: {body.get('not_ready')}; the read {served}\n"
          + report(gap.history, violations, gap.history.writes[0].start))
    assert not violations, "serving rows that miss the recreated topic's updates"
    assert status == 503 and any(topic in reason for reason in body.get("not_ready", [])), body
