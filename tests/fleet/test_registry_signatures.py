"""The registration log is signed (issue F1): a replica applies a registration or unload from
``<prefix>.__registry__.models`` only when ``updates.admin_key`` signed it for that log; a message produced by hand
unsigned, under another key, for another use or another fleet's log, or altered, is refused, logged, counted and
skipped, and the model stays served. Without a key a REST registration is made on this replica only and says so,
and nothing on the log is applied. In-process replicas (no worker processes) and tansu."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from hps_service.config import ModelConfig
from hps_service.fleet.registry_log import REFUSED, REGISTER, UNLOAD, RegistryChange, registry_topic
from hps_service.updates.admin_signature import HEADER, REASONS, registry_context, sign
from tests.fleet.replica import ADMIN_KEY, DIM, Replica
from tests.updates.conftest import wait_until

LOGGER = "hps_service.fleet.registry_log"
OFFSET = re.compile(r"at offset (\d+): ")


def _model(name: str) -> dict:
    return {"name": name, "tables": [{"name": "item", "dim": DIM}]}


def _change(op: str, name: str) -> bytes:
    return RegistryChange(op, name, ModelConfig.model_validate(_model(name)) if op == REGISTER else None).encode()


def _refused() -> dict[str, float]:
    return {reason: REFUSED.labels(reason)._value.get() for reason in REASONS}


def _produce(brokers: str, topic: str, messages: list[tuple[str, bytes, list | None]]) -> None:
    """Produce ``(model, value, headers)`` messages on ``topic`` by hand, as any producer on it could."""
    producer = Producer({"bootstrap.servers": brokers})
    for name, value, headers in messages:
        producer.produce(topic, key=name.encode(), value=value, partition=0, headers=headers)
    assert producer.flush(10) == 0


def _on_the_log(brokers: str, topic: str) -> int:
    """How many messages ``topic`` holds, read to its end (not listed: tansu lists an end a record batch short)."""
    consumer = Consumer({"bootstrap.servers": brokers, "group.id": f"count-{uuid.uuid4().hex[:6]}",
                         "enable.partition.eof": True})
    consumer.assign([TopicPartition(topic, 0, 0)])
    count = 0
    try:
        while True:
            msg = consumer.poll(10)
            assert msg is not None, f"no end of {topic} within 10 s"
            if msg.error() is not None:
                assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
                return count
            count += 1
    finally:
        consumer.close()


def _registry(replica: Replica) -> dict:
    return replica.http.get("/v1/stats").json()["registry"]


@pytest.fixture
def start_replica(kafka_broker, tmp_path: Path) -> Iterator[Callable[[str | None], Replica]]:
    """Starts one replica under ``updates.admin_key`` (None: no key) on a topic prefix of its own; stopped after."""
    started: list[Replica] = []

    def start(admin_key: str | None) -> Replica:
        started.append(Replica(tmp_path, "a", kafka_broker.bootstrap, f"s{uuid.uuid4().hex[:6]}", workers=0,
                               admin_key=admin_key))
        return started[-1]

    try:
        yield start
    finally:
        for rep in started:
            rep.close()


def test_hand_made_registry_messages_are_refused_counted_and_skipped(kafka_broker, start_replica, caplog) -> None:
    """Before: any producer on the registration log unloaded the model on every replica."""
    replica = start_replica(ADMIN_KEY)
    topic = registry_topic(replica.config.updates.topic_prefix)
    metrics = replica.http.get("/metrics").text
    assert all(re.search(rf'^hps_registry_refused_total{{reason="{r}"}} ', metrics, re.M) for r in REASONS)
    r = replica.http.post("/v1/models", json=_model("dyn"))
    assert r.status_code == 201 and r.json()["replicated"] is True, r.text
    keys = np.arange(1, 33, dtype=np.int64)
    assert replica.clients[0].lookup("dyn", "item", keys).shape == (keys.size, DIM)
    before = _refused()

    unload, context = _change(UNLOAD, "dyn"), registry_context(topic)
    signed = [(HEADER, sign(ADMIN_KEY, unload, context))]
    with caplog.at_level(logging.INFO, logger="hps_service"):
        _produce(kafka_broker.bootstrap, topic, [
            ("dyn", unload, None),                                                            # unsigned
            ("dyn", unload, [(HEADER, b"")]),                                                 # empty signature
            ("dyn", unload, [(HEADER, sign("another-key-of-16-chars", unload, context))]),   # another key
            ("dyn", unload, [(HEADER, sign(ADMIN_KEY, unload))]),                             # a purge's signature
            ("dyn", unload, [(HEADER, sign(ADMIN_KEY, unload, registry_context(registry_topic("other"))))]),
            ("dyn", _change(UNLOAD, "dyn2"), signed),                                         # altered
            ("marker", _change(REGISTER, "marker"), [(HEADER, sign(ADMIN_KEY, _change(REGISTER, "marker"),
                                                                   context))]),  # signed: applied
        ])
        assert wait_until(lambda: replica.loaded("marker"), timeout=20), _registry(replica)
    assert replica.loaded("dyn")
    assert replica.clients[0].lookup("dyn", "item", keys).shape == (keys.size, DIM)
    after = _refused()
    assert {r: after[r] - before[r] for r in REASONS} == {"no_key": 0, "unsigned": 1, "bad_signature": 5}
    stats = _registry(replica)
    assert stats["refused"] == {"no_key": 0, "unsigned": 1, "bad_signature": 5} and stats["failed"] == {}
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER and rec.levelno == logging.WARNING]
    assert len(warnings) == 6, warnings
    first = min(int(OFFSET.search(w)[1]) for w in warnings)  # the position advanced past each one
    assert [int(OFFSET.search(w)[1]) - first for w in warnings] == list(range(6)), warnings
    assert [w.split(" at offset")[0].split("refused ")[1] for w in warnings] == (
        ["the unload of model 'dyn'"] * 5 + ["the unload of model 'dyn2'"])
    assert [w.rsplit(": ", 1)[1] for w in warnings] == [REASONS["unsigned"]] + [REASONS["bad_signature"]] * 5
    assert ADMIN_KEY not in caplog.text
    assert ADMIN_KEY not in replica.http.get("/metrics").text + str(stats)

    # The replica's own signed unload still goes through its log.
    r = replica.http.delete("/v1/models/dyn")
    assert r.status_code == 200 and r.json() == {"unloaded": "dyn", "replicated": True}, r.text
    assert not replica.loaded("dyn")


def test_without_a_key_registrations_are_local_and_the_log_is_not_applied(kafka_broker, start_replica,
                                                                           caplog) -> None:
    """Before: registrations were published unsigned, and every replica applied whatever was on the log."""
    replica = start_replica(None)
    topic = registry_topic(replica.config.updates.topic_prefix)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for name in ("solo", "solo2"):
            r = replica.http.post("/v1/models", json=_model(name))
            assert r.status_code == 201 and r.json()["replicated"] is False, r.text
    local = [rec.getMessage() for rec in caplog.records if "updates.admin_key is not set" in rec.getMessage()]
    assert len(local) == 1 and "other replicas will not see them" in local[0], local
    # Ready once the new models' update partitions are assigned and caught up (a moment after the registrations).
    assert wait_until(lambda: replica.http.get("/readyz").status_code == 200, timeout=20), \
        replica.http.get("/readyz").text
    assert wait_until(lambda: _registry(replica)["applied_offset"] == 0, timeout=20), _registry(replica)  # following
    assert _on_the_log(kafka_broker.bootstrap, topic) == 0, "a registration was published without a key"

    unload = _change(UNLOAD, "solo")
    _produce(kafka_broker.bootstrap, topic, [
        ("solo", unload, [(HEADER, sign(ADMIN_KEY, unload, registry_context(topic)))]),  # signed, but by whom?
        ("solo2", _change(UNLOAD, "solo2"), None),
    ])
    assert wait_until(lambda: _registry(replica)["applied_offset"] == 2, timeout=20), _registry(replica)
    stats = _registry(replica)
    assert stats["signed"] is False and stats["refused"] == {"no_key": 2, "unsigned": 0, "bad_signature": 0}
    assert replica.loaded("solo") and replica.loaded("solo2")
    keys = np.arange(1, 9, dtype=np.int64)
    assert replica.clients[0].lookup("solo", "item", keys).shape == (keys.size, DIM)
    # Nothing applied, so no position stored: once a key is set, what was skipped here is read again.
    position = f"registry-position:{topic}"
    assert position not in replica.srv.engine.persistent.metadata(position)

    r = replica.http.delete("/v1/models/solo")
    assert r.status_code == 200 and r.json() == {"unloaded": "solo", "replicated": False}, r.text
    assert not replica.loaded("solo") and replica.loaded("solo2")
    assert _on_the_log(kafka_broker.bootstrap, topic) == 2
