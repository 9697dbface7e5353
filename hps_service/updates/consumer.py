"""The durable update consumer: Kafka -> engine (persistent -> volatile -> L1), offsets committed after apply.

It assigns itself every partition of ``<prefix>.<model>`` at the group's committed offsets (or the earliest for
a new group) instead of joining a group with ``subscribe()``: on tansu a group join waits about half of
``session.timeout.ms``; assign() starts in milliseconds. Each pod uses its own group, so assign() loses nothing.

An offset is committed only once every message before it in its partition was applied, or dead-lettered on its
own (it is malformed, or does not fit the loaded model). A message of a model that is not loaded (unloaded, or
being replaced) is neither: its partition is *parked* at that message (unassigned, nothing after it applied or
committed) and resumes there once the model is loaded again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from hps_service.config import UpdatesConfig
from hps_service.engine import LookupEngine
from hps_service.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.updates.kafka_log import KAFKA_LOG, with_logging
from hps_service.updates.message import (
    DecodedUpdate,
    MalformedUpdateError,
    decode_update,
    dlq_topic_name,
    topic_name,
)
from hps_service.updates.metrics import FreshnessStats
from hps_service.updates.stall import StallDetector
from hps_service.updates.topics import DEFAULT_PARTITIONS, ensure_topic

log = logging.getLogger(__name__)

_CONSUMER_DEFAULTS: dict[str, Any] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "auto.offset.reset": "earliest",
    "enable.partition.eof": False,
    # Latency: the broker answers a fetch after at most 10 ms even when it has nothing new.
    "fetch.wait.max.ms": 10,
    "fetch.min.bytes": 1,
    # librdkafka 2.x backs off 1 s once its local queue is over the thresholds below; keep it short.
    "fetch.queue.backoff.ms": 5,
    "queued.min.messages": 20000,
    "socket.nagle.disable": True,
    "reconnect.backoff.ms": 50,
    "reconnect.backoff.max.ms": 1000,
}


class ModelUnloadedError(Exception):
    """The model of a message is not loaded now (its partition is parked until it is)."""


@dataclass
class _TableBatch:
    """Rows and tombstones of one table gathered from the messages of one polled batch."""

    keys: list[np.ndarray] = field(default_factory=list)
    vectors: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    delete_keys: list[np.ndarray] = field(default_factory=list)
    delete_versions: list[np.ndarray] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)

    def add(self, upd: DecodedUpdate, msg: Message) -> None:
        if upd.keys.shape[0]:
            self.keys.append(upd.keys)
            self.vectors.append(upd.vectors)
            self.versions.append(upd.versions)
        if upd.delete_keys.shape[0]:
            self.delete_keys.append(upd.delete_keys)
            self.delete_versions.append(upd.delete_versions)
        self.messages.append(msg)


def resolve_latest(
    keys: np.ndarray, versions: np.ndarray, delete_keys: np.ndarray, delete_versions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One winner per key among puts and deletes: the highest version; a delete beats a put at the same version,
    and among equal puts the later one wins. Returns (put indices, delete indices) into the given arrays."""
    n = keys.shape[0]
    all_keys = np.concatenate((keys, delete_keys))
    all_versions = np.concatenate((versions, delete_versions))
    is_delete = np.zeros(all_keys.shape[0], dtype=np.int8)
    is_delete[n:] = 1
    order = np.lexsort((np.arange(all_keys.shape[0]), is_delete, all_versions, all_keys))
    sorted_keys = all_keys[order]
    last = np.ones(order.shape[0], dtype=bool)
    last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
    winners = order[last]
    return winners[winners < n], winners[winners >= n] - n


@dataclass
class _Applied:
    """What applying a batch left undone: models unloaded meanwhile (their partitions are parked)."""

    unloaded: set[str] = field(default_factory=set)


class UpdateConsumer:
    """Applies the update topics of ``models`` to ``engine`` in a background thread; see the module docstring.

    ``ready`` turns True once every partition is assigned at a known offset, so nothing published afterwards
    can be missed. ``stop()`` commits what was applied and closes. Malformed messages go to ``<topic>.dlq``.
    """

    def __init__(
        self,
        cfg: UpdatesConfig,
        engine: LookupEngine,
        models: Sequence[str],
        group: str,
        *,
        batch_messages: int = 1000,
        poll_timeout_s: float = 0.05,
        commit_interval_s: float = 0.1,
        close_timeout_s: float = 10.0,
        partitions: int = DEFAULT_PARTITIONS,
        shards: int = 1,
        shard: int = 0,
        consumer_config: dict[str, Any] | None = None,
    ) -> None:
        """``partitions`` is P, used to create missing topics; a shard (``shards`` > 1) assigns only the partitions
        p with p % shards == shard, and refuses a topic whose partition count is not P (its shard map would differ
        from the clients' and the publishers')."""
        if not models:
            raise InvalidArgumentError("UpdateConsumer needs at least one model")
        if not group:
            raise InvalidArgumentError("UpdateConsumer needs a consumer group id")
        if batch_messages < 1:
            raise InvalidArgumentError(f"batch_messages must be >= 1, got {batch_messages}")
        self.cfg = cfg
        self.engine = engine
        self.group = group
        self.topics = {topic_name(m, cfg.topic_prefix): m for m in models}
        self.batch_messages = batch_messages
        self.poll_timeout_s = poll_timeout_s
        self.commit_interval_s = commit_interval_s
        self.close_timeout_s = close_timeout_s
        self.partitions = partitions
        self.shards = shards
        self.shard = shard
        #: Partition count of each update topic as the broker reported it.
        self.topic_partitions: dict[str, int] = {}
        self._client_config = with_logging(
            {**cfg.kafka_config, "bootstrap.servers": cfg.brokers, "socket.nagle.disable": True})
        self._consumer_config = {
            **_CONSUMER_DEFAULTS,
            **cfg.kafka_config,
            **(consumer_config or {}),
            "bootstrap.servers": cfg.brokers,
            "group.id": group,
            "on_commit": self._on_commit,
            "error_cb": self._on_client_error,
            "logger": KAFKA_LOG,
        }
        self.metrics = FreshnessStats()
        self._consumer: Consumer | None = None
        self._dlq: Producer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._commit_on_stop = True
        self._assignment: list[TopicPartition] = []
        self._follow_lock = threading.Lock()
        self._wanted: dict[str, str] | None = None  # topics asked for by follow(), not yet (re)assigned
        self._follow_retry_at = 0.0
        self._start_offsets: dict[tuple[str, int], int] = {}
        self._applied: dict[tuple[str, int], int] = {}  # next offset to read, per partition, applied to the engine
        #: Partitions parked at the offset of the first message whose model was not loaded (see the module doc).
        self._parked: dict[tuple[str, int], int] = {}
        self._committed: dict[tuple[str, int], int] = {}
        self._commit_in_flight_since: float | None = None
        self._last_commit = 0.0
        self._last_lag_refresh = 0.0
        #: Dead letters the broker refused (topic, value, headers): produced again; no commit until they land.
        self._dlq_failed: list[tuple[str, bytes | None, list]] = []
        self.last_error: str | None = None
        #: Why the current batch cannot be applied (a tier write fails); None once it is applied.
        self.apply_error: str | None = None
        #: Flags a stalled stream: messages waiting and none applied for ``cfg.stall_after_s``.
        self.stall = StallDetector(
            cfg.stall_after_s, client_config=self._client_config, name=group,
            applied=lambda: dict(self._applied), starts=lambda: dict(self._start_offsets),
            assigned=lambda: [(tp.topic, tp.partition) for tp in list(self._assignment)],
        )

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once every partition is assigned at a known offset."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ``ready`` (or the timeout); returns ``ready``."""
        return self._ready.wait(timeout)

    def start(self) -> None:
        """Start the background thread (it connects, assigns, then applies batches until stop())."""
        if self._thread is not None:
            raise InvalidArgumentError("UpdateConsumer already started")
        self._thread = threading.Thread(target=self._run, name=f"hps-updates-{self.group}", daemon=True)
        self._thread.start()
        self.stall.start()

    def stop(self, timeout: float = 30.0, commit: bool = True) -> None:
        """Stop the thread; with ``commit`` the offsets of everything applied are committed first, then close."""
        self._commit_on_stop = commit
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("update consumer %s did not stop within %.1fs", self.group, timeout)
        self.stall.stop()

    def follow(self, models: Sequence[str]) -> None:
        """Consume the update topics of exactly ``models`` from now on (models registered or unloaded at runtime).

        A new model's partitions start at this group's committed offsets; an unloaded model's stop being read,
        with their offsets committed up to what was applied, so loading it again resumes where it stopped
        instead of dead-lettering its updates while it is away. The consumer thread makes the change.
        """
        with self._follow_lock:
            self._wanted = {topic_name(m, self.cfg.topic_prefix): m for m in models}

    def stats(self) -> dict:
        """Freshness and ingest state for /v1/stats."""
        out = self.metrics.snapshot()
        out.update(
            ready=self.ready,
            group=self.group,
            topics=sorted(self.topics),
            applied_offsets={f"{t}[{p}]": o for (t, p), o in sorted(self._applied.items())},
            committed_offsets={f"{t}[{p}]": o for (t, p), o in sorted(self._committed.items())},
            parked_offsets={f"{t}[{p}]": o for (t, p), o in sorted(dict(self._parked).items())},
            last_error=self.last_error,
            apply_error=self.apply_error,
            stall=self.stall.snapshot(),
        )
        return out

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                self._connect()
                break
            except (UnavailableError, FailedPreconditionError, KafkaException) as exc:
                self.last_error = str(exc)
                self.metrics.reconnects += 1
                log.warning("update consumer %s cannot reach Kafka (%s); retrying in %.1fs", self.group, exc, backoff)
                self._close_clients(commit=False)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        try:
            while not self._stopping.is_set():
                self._poll_once()
        except Exception:
            log.exception("update consumer %s stopped on an unexpected error", self.group)
            self.last_error = "consumer thread crashed; see log"
            raise
        finally:
            self._close_clients(commit=self._commit_on_stop)

    def _connect(self) -> None:
        consumer = Consumer(self._consumer_config)
        try:
            assignment = self._starting_positions(consumer, list(self.topics))
            consumer.assign(assignment)
        except Exception:
            consumer.close()
            raise
        self._consumer = consumer
        self._assignment = assignment
        self._dlq = Producer({**self._client_config, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
        self._ready.set()
        log.info(
            "update consumer %s assigned %d partitions of %s",
            self.group, len(assignment), ", ".join(sorted(self.topics)),
        )

    def _starting_positions(self, consumer: Consumer, topics: list[str]) -> list[TopicPartition]:
        """Every partition of ``topics`` (created if missing, with their DLQs) where this consumer stopped applying
        (a topic followed again), else at this group's committed offset, else the earliest."""
        admin = AdminClient(self._client_config)
        partitions: dict[str, int] = {}
        for topic in topics:
            partitions[topic] = n = ensure_topic(admin, topic, self.partitions)
            self.topic_partitions[topic] = n
            if n != self.partitions and self.shards > 1:
                raise FailedPreconditionError(
                    f"topic {topic} has {n} partitions but cluster.partitions is {self.partitions}: a shard owns "
                    f"partition % {self.shards} == {self.shard}, so every update topic must have exactly P partitions"
                )
            ensure_topic(admin, dlq_topic_name(topic), 1)
        tps = [TopicPartition(t, p) for t, n in partitions.items() for p in range(n) if p % self.shards == self.shard]
        committed = consumer.committed(tps, timeout=10.0) if tps else []
        assignment = []
        for tp in committed:
            if tp.error is not None:
                raise UnavailableError(f"committed offset of {tp.topic}[{tp.partition}]: {tp.error}")
            start = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            start = max(start, self._applied.get((tp.topic, tp.partition), OFFSET_BEGINNING))
            assignment.append(TopicPartition(tp.topic, tp.partition, start))
            self._start_offsets[(tp.topic, tp.partition)] = start
            if tp.offset >= 0:
                self._committed[(tp.topic, tp.partition)] = tp.offset
        return assignment

    def _follow_changes(self) -> None:
        """Assign the partitions of models follow() added and unassign those of models it dropped."""
        assert self._consumer is not None
        with self._follow_lock:
            wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        dropped = [t for t in self.topics if t not in wanted]
        added = [t for t in wanted if t not in self.topics]
        if dropped:
            gone = [tp for tp in self._assignment if tp.topic in dropped]
            self._consumer.incremental_unassign(gone)
            gone += [TopicPartition(t, p) for t, p in list(self._parked) if t in dropped]
            self._parked = {tp: o for tp, o in self._parked.items() if tp[0] not in dropped}
            self._assignment = [tp for tp in self._assignment if tp.topic not in dropped]
            self.topics = {t: m for t, m in self.topics.items() if t not in dropped}  # replaced: stats() reads it
            self.metrics.forget_partitions([(tp.topic, tp.partition) for tp in gone])
        if added:
            try:
                assignment = self._starting_positions(self._consumer, added)
                self._consumer.incremental_assign(assignment)
            except (UnavailableError, FailedPreconditionError, KafkaException) as exc:
                self.last_error = f"cannot start consuming {', '.join(added)}: {exc}"
                log.warning("update consumer %s: %s; retrying", self.group, self.last_error)
                with self._follow_lock:
                    if self._wanted is None:
                        self._wanted = wanted
                self._follow_retry_at = time.monotonic() + 1.0
                return
            self._assignment.extend(assignment)
            self.topics = {**self.topics, **{t: wanted[t] for t in added}}
        log.info("update consumer %s now follows %s", self.group, ", ".join(sorted(self.topics)) or "no model")

    def _poll_once(self) -> None:
        assert self._consumer is not None and self._dlq is not None
        if self._wanted is not None and time.monotonic() >= self._follow_retry_at:
            self._follow_changes()
        if self._parked:
            self._resume_parked()
        msgs = self._next_batch()
        if msgs:
            self.stall.received()
            self._process(msgs)
        self._dlq.poll(0)
        if self._dlq_failed:
            retry, self._dlq_failed = self._dlq_failed, []
            for topic, value, headers in retry:
                self._produce_dead_letter(topic, value, headers)
        now = time.monotonic()
        if now - self._last_commit >= self.commit_interval_s:
            self._commit()
        if now - self._last_lag_refresh >= 0.5:
            self._refresh_consumer_lag()
            self._last_lag_refresh = now

    def _next_batch(self) -> list[Message]:
        """What is queued now, up to batch_messages; if nothing is, wait for the first message only.

        consume(n, timeout) waits out its whole timeout unless n messages arrive, which would add the poll
        timeout to every update's freshness when traffic is light.
        """
        assert self._consumer is not None
        msgs = self._consumer.consume(num_messages=self.batch_messages, timeout=0)
        if msgs:
            return msgs
        first = self._consumer.poll(self.poll_timeout_s)
        if first is None:
            return []
        if self.batch_messages == 1:
            return [first]
        return [first, *self._consumer.consume(num_messages=self.batch_messages - 1, timeout=0)]

    def _process(self, msgs: list[Message]) -> None:
        groups: dict[tuple[str, str], _TableBatch] = {}
        produced_at: dict[str, list[int]] = {}  # per model
        offsets: dict[tuple[str, int], int] = {}  # per partition, the next offset once this batch is applied
        first: dict[tuple[str, int], int] = {}  # per partition, its first offset in this batch
        park: dict[tuple[str, int], int] = {}
        loaded = {m.name for m in self.engine.models()}
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    self.last_error = err.str()
                    log.warning("update consumer %s: %s", self.group, err.str())
                continue
            topic = msg.topic()
            part = (topic, msg.partition())
            model = self.topics.get(topic)
            if model is None or part in self._parked or part in park:
                continue  # fetched before its partition was dropped or parked: read again from there
            first.setdefault(part, msg.offset())
            try:
                if model not in loaded:
                    raise ModelUnloadedError(model)
                upd = self._validated(model, msg.value())
            except ModelUnloadedError:
                park[part] = msg.offset()
                continue
            except MalformedUpdateError as exc:
                self._dead_letter(msg, model, str(exc))
            else:
                groups.setdefault((model, upd.table), _TableBatch()).add(upd, msg)
                produced_at.setdefault(model, []).append(upd.produced_at_ns)
            offsets[part] = msg.offset() + 1
        applied = self._apply(groups)
        if applied is None:
            return  # stopping with this batch unapplied: its offsets stay uncommitted and are read again
        for model in applied.unloaded:  # unloaded while its batch was applied: read it all again once it is back
            produced_at.pop(model, None)
            for part, offset in first.items():
                if self.topics.get(part[0]) == model:
                    park[part] = min(offset, park.get(part, offset))
        for part, offset in park.items():
            offsets[part] = offset
        now_ns = time.time_ns()
        for model, stamps in produced_at.items():
            lags = (now_ns - np.asarray(stamps, dtype=np.int64)) / 1e9
            self.metrics.record_lags(np.maximum(lags, 0.0), model)
        self.metrics.messages_total += sum(len(stamps) for stamps in produced_at.values())
        self.metrics.batches_total += 1
        self._applied.update(offsets)
        if park:
            self._park(park)

    def _park(self, parts: dict[tuple[str, int], int]) -> None:
        """Stop reading ``parts`` at the given offsets (their model is not loaded) until it is loaded again."""
        assert self._consumer is not None
        gone = [TopicPartition(t, p) for t, p in parts]
        self._consumer.incremental_unassign(gone)
        self._assignment = [tp for tp in self._assignment if (tp.topic, tp.partition) not in parts]
        self._parked.update(parts)
        log.warning("update consumer %s: model %s is not loaded; %s parked until it is", self.group,
                    ", ".join(sorted({self.topics.get(t, t) for t, _ in parts})),
                    ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(parts.items())))

    def _resume_parked(self) -> None:
        """Assign again, at their parked offsets, the parked partitions whose model is loaded now."""
        assert self._consumer is not None
        loaded = {m.name for m in self.engine.models()}
        back = {part: o for part, o in self._parked.items() if self.topics.get(part[0]) in loaded}
        if not back:
            return
        assignment = [TopicPartition(t, p, o) for (t, p), o in back.items()]
        self._consumer.incremental_assign(assignment)
        self._assignment.extend(TopicPartition(t, p) for t, p in back)
        self._parked = {part: o for part, o in self._parked.items() if part not in back}
        log.info("update consumer %s: resumed %s", self.group,
                 ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(back.items())))

    def _validated(self, model: str, payload: bytes | None) -> DecodedUpdate:
        upd = decode_update(payload)
        if upd.model != model:
            raise MalformedUpdateError(f"message for model {upd.model!r} on the topic of model {model!r}")
        dim = self._table_dim(model, upd.table)
        if upd.keys.shape[0] and upd.dim != dim:
            raise MalformedUpdateError(f"rows of dim {upd.dim} for table {model}.{upd.table} of dim {dim}")
        return upd

    def _table_dim(self, model: str, table: str) -> int:
        """The dim of a loaded table; ModelUnloadedError when the model is not loaded, MalformedUpdateError when it
        has no such table."""
        try:
            return self.engine.table(model, table).dim
        except NotFoundError as exc:
            if not any(m.name == model for m in self.engine.models()):
                raise ModelUnloadedError(model) from None
            raise MalformedUpdateError(str(exc)) from None

    def _apply(self, groups: dict[tuple[str, str], _TableBatch]) -> _Applied | None:
        """Apply every table's rows and tombstones; retry transient failures until done (None if stopping first).

        A batch the engine rejects is applied message by message, and only the messages it rejects on their own
        are dead-lettered; a batch whose model was unloaded meanwhile is left for when it is back.
        """
        backoff = 0.05
        pending = dict(groups)
        done = _Applied()
        while pending:
            for (model, table), batch in list(pending.items()):
                if model in done.unloaded:
                    del pending[(model, table)]
                    continue
                try:
                    self._apply_table(model, table, batch)
                    del pending[(model, table)]
                except ModelUnloadedError:
                    done.unloaded.add(model)
                    del pending[(model, table)]
                except (InvalidArgumentError, MalformedUpdateError) as exc:
                    if len(batch.messages) > 1:
                        self._apply_one_by_one(model, table, batch, done)
                    else:
                        self._dead_letter(batch.messages[0], model, f"rejected by the engine: {exc}")
                    del pending[(model, table)]
                except Exception as exc:  # noqa: BLE001  (a tier is down: retry the same rows, commit nothing)
                    self.metrics.apply_failures += 1
                    self.last_error = self.apply_error = f"apply to {model}.{table} failed: {exc}"
                    log.warning("update consumer %s: %s; retrying in %.2fs", self.group, self.last_error, backoff)
            if pending:
                if self._stopping.wait(backoff):
                    return None
                backoff = min(backoff * 2, 2.0)
        self.apply_error = None
        return done

    def _apply_one_by_one(self, model: str, table: str, batch: _TableBatch, done: _Applied) -> None:
        """Apply a rejected batch message by message (in offset order), dead-lettering the ones rejected alone."""
        for msg in batch.messages:
            single = _TableBatch()
            single.add(decode_update(msg.value()), msg)
            try:
                self._apply_table(model, table, single)
            except ModelUnloadedError:
                done.unloaded.add(model)
                return
            except (InvalidArgumentError, MalformedUpdateError) as exc:
                self._dead_letter(msg, model, f"rejected by the engine: {exc}")

    def _apply_table(self, model: str, table: str, batch: _TableBatch) -> None:
        """Apply one table's batch; ModelUnloadedError / MalformedUpdateError when the model or table is gone."""
        dim = self._table_dim(model, table)
        keys = np.concatenate(batch.keys) if batch.keys else np.empty(0, dtype=np.int64)
        vectors = np.concatenate(batch.vectors) if batch.vectors else np.empty((0, dim), dtype=np.float32)
        versions = np.concatenate(batch.versions) if batch.versions else np.empty(0, dtype=np.int64)
        del_keys = np.concatenate(batch.delete_keys) if batch.delete_keys else np.empty(0, dtype=np.int64)
        del_versions = (
            np.concatenate(batch.delete_versions) if batch.delete_versions else np.empty(0, dtype=np.int64)
        )
        puts, deletes = resolve_latest(keys, versions, del_keys, del_versions)
        try:
            if puts.shape[0]:
                self.engine.apply_updates(model, table, keys[puts], vectors[puts], versions[puts])
            if deletes.shape[0]:
                self.engine.apply_deletes(model, table, del_keys[deletes], del_versions[deletes])
        except NotFoundError:
            self._table_dim(model, table)  # raises why: the model unloaded, or the table gone from it
            raise  # the table is back (replaced meanwhile): a transient failure, retried
        top = max(
            int(versions.max()) if versions.shape[0] else -1, int(del_versions.max()) if del_versions.shape[0] else -1
        )
        self.metrics.record_applied(
            model,
            table,
            rows=int(puts.shape[0] + deletes.shape[0]),
            received=int(keys.shape[0] + del_keys.shape[0]),
            max_version=top if top >= 0 else None,
        )

    # ---- dead letters, commits, lag -----------------------------------------------------------
    def _dead_letter(self, msg: Message, model: str, reason: str) -> None:
        assert self._dlq is not None
        self.metrics.record_malformed(model)
        log.warning(
            "update consumer %s: malformed message %s[%d]@%d: %s",
            self.group, msg.topic(), msg.partition(), msg.offset(), reason,
        )
        headers = [
            ("hps-error", reason.encode()),
            ("hps-source", f"{msg.topic()}[{msg.partition()}]@{msg.offset()}".encode()),
        ]
        self._produce_dead_letter(dlq_topic_name(msg.topic()), msg.value(), headers)

    def _produce_dead_letter(self, topic: str, value: bytes | None, headers: list) -> None:
        assert self._dlq is not None
        while True:
            try:
                self._dlq.produce(topic, value=value, headers=headers, on_delivery=self._on_dead_letter_delivery)
                return
            except BufferError:
                self._dlq.poll(0.05)

    def _on_dead_letter_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self.last_error = f"dead letter to {msg.topic()} failed: {err.str()}"
            self._dlq_failed.append((msg.topic(), msg.value(), list(msg.headers() or [])))

    def _commit(self) -> None:
        """Start an async commit of the applied offsets ahead of the committed ones (once dead letters landed)."""
        assert self._consumer is not None and self._dlq is not None
        self._last_commit = time.monotonic()
        in_flight = self._commit_in_flight_since
        if in_flight is not None and self._last_commit - in_flight < 5.0:
            return
        todo = [TopicPartition(t, p, o) for (t, p), o in self._applied.items() if o > self._committed.get((t, p), -1)]
        if not todo:
            return
        if len(self._dlq) and self._dlq.flush(0):
            return  # dead letters not yet acknowledged: committing past them could lose them
        if self._dlq_failed:
            return
        try:
            self._commit_in_flight_since = self._last_commit
            self._consumer.commit(offsets=todo, asynchronous=True)
        except KafkaException as exc:
            self._commit_in_flight_since = None
            self.metrics.commit_failures += 1
            self.last_error = f"commit failed: {exc}"
            log.warning("update consumer %s: %s", self.group, self.last_error)

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        self._commit_in_flight_since = None
        if err is not None:
            self.metrics.commit_failures += 1
            self.last_error = f"commit failed: {err}"
            return
        for tp in partitions or []:
            if tp.error is None and tp.offset >= 0:
                key = (tp.topic, tp.partition)
                self._committed[key] = max(self._committed.get(key, -1), tp.offset)

    def _on_client_error(self, err: KafkaError) -> None:
        self.last_error = err.str()
        log.debug("update consumer %s: client error %s", self.group, err.str())

    def _refresh_consumer_lag(self) -> None:
        assert self._consumer is not None
        for tp in self._assignment:
            try:
                low, high = self._consumer.get_watermark_offsets(tp, cached=True)
            except KafkaException:
                continue
            if high < 0:
                continue
            key = (tp.topic, tp.partition)
            start = self._start_offsets.get(key, OFFSET_BEGINNING)
            done = self._applied.get(key, start if start >= 0 else max(low, 0))
            self.metrics.record_consumer_lag(tp.topic, tp.partition, max(0, high - done))

    def _final_commit(self, timeout_s: float) -> None:
        """Commit everything applied, waiting at most ``timeout_s`` (a frozen broker must not block stop())."""
        assert self._consumer is not None and self._dlq is not None
        deadline = time.monotonic() + timeout_s
        self._consumer.pause(self._assignment)  # nothing more is fetched while we wait for the commit
        if len(self._dlq):
            self._dlq.flush(timeout_s / 2)
        if len(self._dlq) or self._dlq_failed:
            log.warning("update consumer %s: dead letters undelivered; offsets left uncommitted", self.group)
            return
        todo = [TopicPartition(t, p, o) for (t, p), o in self._applied.items() if o > self._committed.get((t, p), -1)]
        if not todo:
            return
        self._consumer.commit(offsets=todo, asynchronous=True)
        while time.monotonic() < deadline:
            if all(self._committed.get((tp.topic, tp.partition), -1) >= tp.offset for tp in todo):
                return
            self._consumer.poll(0.05)  # serves the commit callback
        log.warning("update consumer %s: final commit not confirmed within %.1fs", self.group, timeout_s)

    def _close_clients(self, commit: bool) -> None:
        if self._consumer is not None:
            if commit:
                try:
                    self._final_commit(self.close_timeout_s)
                except KafkaException as exc:
                    log.warning("update consumer %s: final commit failed: %s", self.group, exc)
            self._consumer.close()
            self._consumer = None
        if self._dlq is not None:
            self._dlq.flush(self.close_timeout_s / 2)
            self._dlq = None
        self._ready.clear()
