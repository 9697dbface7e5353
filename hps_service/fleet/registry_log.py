"""Runtime model registrations through the update log, as admin row writes go (:mod:`fleet.admin_writes`).

With Kafka updates on, ``POST /v1/models`` and ``DELETE /v1/models/{model}`` publish the change to one topic,
``<prefix>.__registry__.models`` (one partition, compacted, keyed by model name), and every replica of the fleet
applies the changes in log order, so that a model registered on one replica is served by every one. The REST call
returns once this replica has applied its own change (and, in a node, every gRPC worker serves it). The position
applied up to is kept in the persistent tier's metadata, so that a restart resumes there; a replica is not ready
until it has applied the registrations that were on the log when it started.

Every change on the log is signed with ``updates.admin_key`` (:mod:`updates.admin_signature`), and a replica
applies only those whose signature is good: any producer on the topic could otherwise unload every model of every
replica. A refused one is logged (WARNING), counted in ``hps_registry_refused_total{reason}`` and skipped. Without a
key nothing is published (a change is made on the replica asked only) and nothing on the log is applied.

Models the config defines belong to the config: a change to one is made only where it is asked for (as without
Kafka), and other replicas skip it. A change that fails to apply here is logged (ERROR) and skipped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import Counter

from hps_service.config import ModelConfig, UpdatesConfig
from hps_service.engine.api import Engine
from hps_service.errors import HPSError, UnavailableError
from hps_service.fleet.switch_gate import SwitchGate
from hps_service.runtime.background import BackgroundThread
from hps_service.tiers.base import Tier
from hps_service.updates.admin_signature import REASONS, Signature, registry_context
from hps_service.updates.catch_up import CatchUp
from hps_service.updates.consumed import headers as consumed_headers
from hps_service.updates.consumed import position
from hps_service.updates.kafka_log import KAFKA_LOG, with_logging
from hps_service.updates.publisher import connection_settings
from hps_service.updates.topics import ensure_topic
from hps_service.updates.watermarks import BrokerLogs

log = logging.getLogger(__name__)

REGISTER, UNLOAD, LABEL, STATUS = "register", "unload", "label", "status"
REFUSED = Counter("hps_registry_refused_total",
                  "Changes on the registration log refused (not applied: unsigned, badly signed, or no key here), by why",
                  ["reason"])
for _reason in REASONS:
    REFUSED.labels(_reason)


def registry_topic(prefix: str) -> str:
    """The topic of runtime registrations (no model's topic: a model name has no dot)."""
    return f"{prefix}.__registry__.models"


@dataclass(frozen=True)
class RegistryChange:
    """One registration (``model`` set) or unload of a model or version (``name``: its served name), or a label
    switch (``label`` of model ``of`` to ``version``, None: removed), as it travels on the log."""

    op: str
    name: str
    model: ModelConfig | None = None
    of: str = ""
    label: str = ""
    version: int | None = None
    #: A replica's status for the switch gate (:mod:`hps_service.fleet.switch_gate`), keyed by the replica.
    status: dict[str, Any] | None = None

    @staticmethod
    def switch(model: str, label: str, version: int | None) -> RegistryChange:
        """The switch of ``label`` of ``model`` to ``version`` (keyed by the label: compaction keeps the last)."""
        return RegistryChange(LABEL, f"label:{model}/{label}", of=model, label=label, version=version)

    @staticmethod
    def of_status(status: dict[str, Any]) -> RegistryChange:
        """A replica's status (keyed by the replica: compaction keeps its last)."""
        return RegistryChange(STATUS, f"status:{status['replica']}", status=status)

    def encode(self) -> bytes:
        data: dict[str, Any] = {"op": self.op, "name": self.name,
                                "model": self.model.model_dump(mode="json") if self.model else None}
        if self.op == LABEL:
            data.update({"of": self.of, "label": self.label, "version": self.version})
        if self.op == STATUS:
            data["status"] = self.status
        return json.dumps(data).encode()

    @staticmethod
    def decode(payload: bytes | None) -> RegistryChange:
        """The change a message carries; ValueError when it carries none."""
        data = json.loads(payload or b"null")
        if not isinstance(data, dict) or data.get("op") not in (REGISTER, UNLOAD, LABEL, STATUS) or not isinstance(
                data.get("name"), str):
            raise ValueError(f"not a registration: {str(payload)[:200]}")
        if data["op"] == STATUS:
            status = data.get("status")
            if not isinstance(status, dict) or not isinstance(status.get("replica"), str) or not isinstance(
                    status.get("at"), (int, float)) or not isinstance(status.get("served"), dict):
                raise ValueError(f"not a replica status: {str(payload)[:200]}")
            return RegistryChange.of_status(status)
        if data["op"] == LABEL:
            version = data.get("version")
            if not isinstance(data.get("of"), str) or not isinstance(data.get("label"), str) or not (
                    version is None or (isinstance(version, int) and version >= 0)):
                raise ValueError(f"not a label switch: {str(payload)[:200]}")
            change = RegistryChange.switch(data["of"], data["label"], version)
            if change.name != data["name"]:
                raise ValueError(f"label switch of {change.name!r} keyed {data['name']!r}")
            return change
        model = ModelConfig.model_validate(data["model"]) if data["op"] == REGISTER else None
        if model is not None and model.served_name != data["name"]:
            raise ValueError(f"registration of {model.served_name!r} keyed {data['name']!r}")
        return RegistryChange(data["op"], data["name"], model)


def claimed(payload: bytes | None, key: bytes | None) -> str:
    """What a message not yet trusted says it is, for a log line: ``the unload of model 'x'`` (cut and quoted)."""
    try:
        data = json.loads(payload or b"null")
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("name"), str):
        op = data["op"] if data.get("op") in (REGISTER, UNLOAD) else "change"
        return f"the {op} of model {data['name'][:100]!r}"
    return f"a message keyed {(key or b'')[:100]!r}"


class ModelRegistrations:
    """Registers and unloads models at runtime: through the registration log when there is one (``log()``) and
    it signs, else on this replica only; :meth:`apply` is what the log's follower calls for every change on the log."""

    def __init__(self, engine: Engine, configured: Collection[str], changed: Callable[[], None],
                 log_of: Callable[[], RegistryLog | None] = lambda: None, timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.configured = set(configured)
        self.changed = changed
        self.log_of = log_of
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one change at a time, from REST or the log
        self._warned_local = False
        #: Holds a label switch back until every replica can take it (set by the fleet when the log signs).
        self.gate: SwitchGate | None = None

    def register(self, model: ModelConfig) -> bool:
        """Serve ``model`` (a model, or a version of one) here (and, through the log, on every replica) before this
        returns; True when the change went through the log, False when it was made on this replica only."""
        return self._through_log(RegistryChange(REGISTER, model.served_name, model))

    def unload(self, name: str) -> bool:
        """Stop serving ``name`` (a served name; a version's rows are dropped) here (and, through the log, on every
        replica) before this returns; True when the change went through the log, False when it was made on this
        replica only."""
        self.engine.model(name)  # NotFoundError for a model not loaded
        return self._through_log(RegistryChange(UNLOAD, name))

    def set_label(self, model: str, label: str, version: int | None, allow_empty: bool = False) -> bool:
        """Point ``label`` of ``model`` at ``version`` (None: remove it) here (and, through the log, on every replica
        and shard, at the same offset of the one-partition log) before this returns; whether it travelled. Through
        the log, the switch waits until every replica reports the version switchable (``allow_empty``: tables
        without rows included; FailedPreconditionError naming what is missing, after a while)."""
        registry = self.log_of()
        if version is not None and self.gate is not None and registry is not None and registry.signs:
            self.gate.wait(model, version, allow_empty=allow_empty)
        return self._through_log(RegistryChange.switch(model, label, version))

    def _through_log(self, change: RegistryChange) -> bool:
        """Makes ``change`` through the log when it can travel (a log, a key to sign it, a model the config does not
        define), else on this replica only; whether it travelled."""
        registry = self.log_of()
        if registry is not None and not registry.signs and change.name not in self.configured:
            self._warn_local_once(registry.topic)
        if registry is None or not registry.signs or change.name in self.configured:
            self._apply(change, "REST API")
            return False
        offset = registry.publish(change)
        if not registry.wait_applied(offset, self.timeout_s):
            raise UnavailableError(f"the {change.op} of model {change.name} is on the log, but this replica did "
                                   f"not apply it within {self.timeout_s:g} s")
        if registry.failed.get(offset):
            raise UnavailableError(f"the {change.op} of model {change.name} is on the log, but this replica could "
                                   f"not apply it: {registry.failed[offset]}")
        return True

    def _warn_local_once(self, topic: str) -> None:
        if not self._warned_local:
            self._warned_local = True
            log.warning("updates.admin_key is not set, so model registrations and unloads are made on this replica "
                        "only: other replicas will not see them (nor does this one apply theirs from %s). To carry "
                        "them to every replica, set updates.admin_key, the same on every replica", topic)

    def apply(self, change: RegistryChange) -> None:
        """A change read from the log: applied unless the config defines the model or it changes nothing (a
        replica's status goes to the switch gate)."""
        if change.op == STATUS:
            if self.gate is not None and change.status is not None:
                self.gate.record(change.status)
            return
        if change.name in self.configured:
            log.info("model %s is defined by the config; its %s on the registration log is skipped", change.name,
                     change.op)
            return
        self._apply(change, "registration log")

    def _apply(self, change: RegistryChange, source: str) -> None:
        with self._lock:
            loaded = {m.served_name: m for m in self.engine.served_models()}
            if change.op == LABEL:
                self.engine.set_label(change.of, change.label, change.version)
                return
            if change.model is not None:
                if loaded.get(change.name) == change.model:
                    return
                if change.model.version:
                    self.engine.add_version(change.model, source)
                else:
                    self.engine.register_model(change.model)
            elif change.name in loaded:
                if loaded[change.name].version:
                    self.engine.drop_version(loaded[change.name].name, loaded[change.name].version)
                else:
                    self.engine.unregister_model(change.name)
            else:
                return
            self.changed()


class RegistryLog:
    """The registration log of one replica: publishes changes, and applies every change on it in a thread."""

    def __init__(self, cfg: UpdatesConfig, tier: Tier | None, apply: Callable[[RegistryChange], None], group: str,
                 ack_timeout_s: float = 30.0) -> None:
        self.cfg = cfg
        self.topic = registry_topic(cfg.topic_prefix)
        self.part = (self.topic, 0)
        self._tier = tier
        self._apply = apply
        self._signature = Signature(cfg.admin_key, registry_context(self.topic))
        self.ack_timeout_s = ack_timeout_s
        self._client = with_logging({**cfg.kafka_config, "bootstrap.servers": cfg.brokers})
        self._consumer_config = {**self._client, "group.id": f"{group}.registry", "enable.auto.commit": False,
                                 "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10, "logger": KAFKA_LOG}
        self._producer = Producer(with_logging({**connection_settings(cfg.kafka_config), "bootstrap.servers":
                                                cfg.brokers, "enable.idempotence": True, "acks": "all",
                                                "linger.ms": 0}))
        self.catch_up = CatchUp(0.0)
        self.applied = -1  # next offset, applied
        #: Offsets of changes this replica could not apply, and why (answered to the REST call that made them).
        self.failed: dict[int, str] = {}
        #: Changes on the log refused here (not applied), by reason.
        self.refused = dict.fromkeys(REASONS, 0)
        #: The offset of the last switch of each label applied here (every replica's are the same: one log).
        self.label_offsets: dict[str, int] = {}
        self.last_error: str | None = None
        self._worker = BackgroundThread("hps-registry", self._run)
        self._stop = self._worker.stopping

    # ---- the REST side ------------------------------------------------------------------------
    @property
    def signs(self) -> bool:
        """Whether this replica signs (publishes) changes and applies signed ones: ``updates.admin_key`` is set."""
        return self._signature.can_sign

    def publish(self, change: RegistryChange) -> int:
        """Put ``change`` on the log, signed; returns its offset once the broker acknowledged it."""
        acked: dict[str, Any] = {}
        value = change.encode()
        headers = self._signature.headers(value)

        def delivered(err: KafkaError | None, msg: Message) -> None:
            acked["err"], acked["offset"] = err, msg.offset()

        try:
            self._producer.produce(self.topic, key=change.name.encode(), value=value, partition=0, headers=headers,
                                   on_delivery=delivered)
        except (KafkaException, BufferError) as exc:
            raise UnavailableError(f"cannot publish the {change.op} of model {change.name}: {exc}") from None
        self._producer.flush(self.ack_timeout_s)
        if "offset" not in acked or acked["err"] is not None:
            raise UnavailableError(f"the {change.op} of model {change.name} was not acknowledged by the broker: "
                                   f"{acked.get('err') or 'timed out'}")
        return int(acked["offset"])

    def wait_applied(self, offset: int, timeout: float) -> bool:
        """Block until the change at ``offset`` is applied here (or the timeout)."""
        deadline = time.monotonic() + timeout
        with self.catch_up.cond:
            while self.applied <= offset:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.catch_up.cond.wait(min(remaining, 0.1))
        return True

    def stats(self) -> dict[str, Any]:
        """The ``registry`` section of /v1/stats."""
        return {"topic": self.topic, "signed": self.signs, "applied_offset": self.applied,
                "catching_up": self.not_ready() is not None, "failed": {str(o): why for o, why in self.failed.items()},
                "refused": dict(self.refused), "last_error": self.last_error, "label_offsets": dict(self.label_offsets)}

    def not_ready(self) -> str | None:
        """Why this replica has not applied the registrations on the log yet, or None (always without a key: it
        applies none)."""
        if not self._worker.started or not self.signs:
            return None
        if self.applied < 0:
            reason = f"registration log {self.topic} not read yet"
            return f"{reason}: {self.last_error}" if self.last_error else reason
        return self.catch_up.reason({self.part}, {self.part: self.applied})

    # ---- the follower -------------------------------------------------------------------------
    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._worker.stop(timeout)
        self._producer.flush(min(timeout, 5.0))

    def _stored(self) -> int:
        value = self._tier.metadata(self._key()).get(self._key()) if self._tier is not None else None
        return int(value) if value else 0

    def _key(self) -> str:
        return f"registry-position:{self.topic}"

    def _store(self, offset: int) -> None:
        if self._tier is not None:
            self._tier.set_metadata(self._key(), str(offset).encode())

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            consumer = None
            try:
                consumer = self._connect()
                while not self._stop.is_set():
                    self._poll(consumer)
            except (HPSError, KafkaException) as exc:
                self.last_error = str(exc)
                log.warning("registration log %s: %s; retrying in %.1fs", self.topic, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if consumer is not None:
                    consumer.close()

    def _refuse(self, msg: Message, reason: str) -> None:
        """Skip a message whose signature is not good (the position advances past it), logged and counted."""
        REFUSED.labels(reason).inc()
        self.refused[reason] += 1
        hint = "; set updates.admin_key, the same on every replica, to apply the fleet's" if reason == "no_key" else ""
        log.warning("registration log %s: refused %s at offset %d: %s%s", self.topic,
                    claimed(msg.value(), msg.key()), msg.offset(), REASONS[reason], hint)

    def _connect(self) -> Consumer:
        ensure_topic(AdminClient(self._client), self.topic, 1, replication_factor=self.cfg.replication_factor,
                     min_insync_replicas=self.cfg.min_insync_replicas, config={"cleanup.policy": "compact"})
        logs = BrokerLogs(self._client)
        low, high = logs.starts([self.part]).get(self.part), logs.ends([self.part]).get(self.part)
        if low is None or high is None:
            raise UnavailableError(f"the broker did not answer the offsets of {self.topic}")
        begin = max(self._stored(), low)
        consumer = Consumer(self._consumer_config)
        consumer.assign([TopicPartition(self.topic, 0, begin)])
        self.catch_up.assigned(self.part, begin, high)
        with self.catch_up.cond:
            self.applied = begin
            self.catch_up.cond.notify_all()
        return consumer

    def _poll(self, consumer: Consumer) -> None:
        # the first message as soon as it is there (consume() would wait out its whole timeout for 500), then
        # whatever else is already fetched: a change is applied within a fetch of being published
        first = consumer.poll(0.1)
        msgs = [] if first is None else [first, *consumer.consume(num_messages=499, timeout=0)]
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    self.last_error = err.str()
                continue
            offset = position(msg).offset
            if offset < self.applied:
                continue
            reason = self._signature.refusal(msg.value() or b"", consumed_headers(msg))
            if reason is not None:
                self._refuse(msg, reason)
            else:
                try:
                    change = RegistryChange.decode(msg.value())
                    self._apply(change)
                    if change.op == LABEL:
                        self.label_offsets = {**self.label_offsets, change.name: offset}
                except Exception as exc:  # noqa: BLE001  (logged and skipped: one change must not stop the others)
                    self.failed = {**dict(list(self.failed.items())[-99:]), offset: str(exc)}
                    log.error("registration log %s: the change at offset %d was not applied here: %s", self.topic,
                              offset, exc)
            with self.catch_up.cond:
                self.applied = offset + 1
        high = consumer.get_watermark_offsets(TopicPartition(self.topic, 0), cached=True)[1]
        if 0 <= high < self.applied:  # another topic of that name, shorter: read it from its start
            log.warning("registration log %s: position %d is past its end %d; reading it again", self.topic,
                        self.applied, high)
            consumer.assign([TopicPartition(self.topic, 0, 0)])
            self.catch_up.assigned(self.part, 0, high)
            with self.catch_up.cond:
                self.applied = 0
            return
        if msgs and self.signs:  # without a key nothing is applied: once one is set, what was skipped is read again
            self._store(self.applied)
        with self.catch_up.cond:
            self.catch_up.advance({self.part: self.applied}, {self.part: high})

