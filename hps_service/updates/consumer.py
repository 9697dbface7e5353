"""The durable update consumer: Kafka -> engine (persistent -> volatile -> L1), positions stored with the rows.

Each batch is applied with one atomic persistent write that also stores, per (topic, partition), the offset it was
applied up to; on start every partition resumes from those stored positions (a store restored from a snapshot
resumes from the snapshot's), or from the earliest offset where the store holds none. Offsets are still committed
to the consumer group, after the apply, for lag monitoring.

It assigns itself the partitions of ``<prefix>.<model>`` instead of joining a group with ``subscribe()``: on tansu
a group join waits about half of ``session.timeout.ms``; assign() starts in milliseconds. Each pod uses its own
group, so assign() loses nothing.

Caught up: at assignment the consumer notes each partition's end offset; a model is caught up once every one of its
partitions is applied up to there, as its fetch responses confirm the end (:mod:`hps_service.updates.catch_up`).
Afterwards the age of the oldest unapplied update is tracked; beyond ``updates.max_lag_s`` the model must catch up
again. A partition that lost updates (its position below the log's start, its topic created again) is never
skipped: it is stopped and the model is not ready (:mod:`hps_service.updates.watermarks`).

An offset is stored (and committed) only once every message before it in its partition was applied, or dead-lettered on its
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
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from hps_service.config import UpdatesConfig
from hps_service.engine import LookupEngine, TableChange
from hps_service.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.updates.admin_signature import AdminMessages
from hps_service.updates.batch import TableBatch, table_change
from hps_service.updates.catch_up import CatchUp
from hps_service.updates.commits import OffsetCommits
from hps_service.updates.dead_letters import DeadLetters
from hps_service.updates.gaps import OffsetGaps
from hps_service.updates.kafka_log import KAFKA_LOG, with_logging
from hps_service.updates.log_losses import LogLosses
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
from hps_service.updates.watermarks import LOG_GAPS, BrokerLogs, LogLedger, LogWatch, LostLog, check_start

log = logging.getLogger(__name__)

_CONSUMER_DEFAULTS: dict[str, Any] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    # An offset out of range is reported, never reset: below the log's start it means lost updates (see watermarks).
    "auto.offset.reset": "error",
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
class _Applied:
    """What applying a batch left undone: models unloaded meanwhile (their partitions are parked)."""

    unloaded: set[str] = field(default_factory=set)


class UpdateConsumer(LogLosses, OffsetCommits):
    """Applies the update topics of ``models`` to ``engine`` in a background thread; see the module docstring.

    ``ready`` turns True once every partition is assigned at a known offset, so nothing published afterwards
    can be missed; ``caught_up()`` once what was on the topics then is applied too. ``stop()`` commits what was
    applied and closes. Malformed messages go to ``<topic>.dlq``.
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
        self.metrics.expect(models)
        self.admin_messages = AdminMessages(cfg.admin_key)
        self._consumer: Consumer | None = None
        self._dlq: DeadLetters | None = None
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
        #: Catch-up targets, confirmed log ends and lag per partition.
        self.catch_up = CatchUp(cfg.max_lag_s)
        self._applied_cond = self.catch_up.cond
        #: Where the logs start and end and which topics they are; partitions that lost updates (stopped, durable).
        self.logs = BrokerLogs(self._client_config)
        self.ledger = LogLedger(engine.persistent)
        self._lost: dict[tuple[str, int], LostLog] = {}
        self._recovering: dict[tuple[str, int], int] = {}  # partitions bootstrapped again, to resume there
        self._past_end_seen: dict[tuple[str, int], int] = {}
        self.log_watch = LogWatch(self.logs, self.ledger, self._positions, cfg.log_check_interval_s, group)
        self._replication = {"replication_factor": cfg.replication_factor,
                             "min_insync_replicas": cfg.min_insync_replicas}
        self._committed: dict[tuple[str, int], int] = {}
        self._commit_in_flight_since: float | None = None
        self._last_commit = 0.0
        self._last_lag_refresh = 0.0
        self.last_error: str | None = None
        #: Unexpected errors the consumer thread survived (each batch then read again from what was applied).
        self.errors = 0
        #: Why the current batch cannot be applied (a tier write fails); None once it is applied.
        self.apply_error: str | None = None
        #: Where each partition's next message must be; a gap is read again before it is skipped.
        self.gaps = OffsetGaps(cfg.offset_gap_recheck_s)
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

    def catching_up(self, model: str | None = None) -> str | None:
        """Why ``model`` (every model with None) is not caught up, or None when it is: not assigned yet, partitions
        that lost updates, partitions not yet applied up to their end offsets, or an unapplied update older than
        ``max_lag_s``."""
        if not self.ready:
            return "update consumer has no partitions yet"
        if lost := self.lost_reason(model):
            return lost
        topics = self._topics_of(model)
        return self.catch_up.reason({p for p in self.catch_up.targets if p[0] in topics}, self._applied)

    def caught_up(self, model: str | None = None) -> bool:
        """Whether every partition of ``model`` (of every model with None) is applied up to its target."""
        return self.catching_up(model) is None

    def wait_caught_up(self, timeout: float | None = None) -> bool:
        """Block until :meth:`caught_up` (or the timeout); returns it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._applied_cond:
            while not self.caught_up():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._applied_cond.wait(0.1 if remaining is None else min(remaining, 0.1))
        return True

    def end_offsets(self, model: str) -> dict[tuple[str, int], int]:
        """The end offset of each assigned partition of ``model``, asked of the broker now."""
        if not self.ready:
            raise UnavailableError("the update consumer has no partitions yet")
        keys = [(tp.topic, tp.partition) for tp in list(self._assignment) if self.topics.get(tp.topic) == model]
        out = self.logs.ends(keys)
        if len(out) != len(keys):
            raise UnavailableError(f"the broker did not answer the end offsets of {model}'s partitions")
        return out

    def wait_applied(self, positions: dict[tuple[str, int], int], timeout: float) -> bool:
        """Block until every ``(topic, partition) -> offset`` in ``positions`` is applied (the message at that
        offset included), or the timeout; returns whether it was."""
        deadline = time.monotonic() + timeout
        with self._applied_cond:
            while not all(max(self._applied.get(k, -1), self._start_offsets.get(k, -1)) > o
                          for k, o in positions.items()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._applied_cond.wait(min(remaining, 0.1))
        return True

    def start(self) -> None:
        """Start the background thread (it connects, assigns, then applies batches until stop())."""
        if self._thread is not None:
            raise InvalidArgumentError("UpdateConsumer already started")
        self._thread = threading.Thread(target=self._run, name=f"hps-updates-{self.group}", daemon=True)
        self._thread.start()
        self.stall.start()
        self.log_watch.start()

    def stop(self, timeout: float = 30.0, commit: bool = True) -> None:
        """Stop the thread; with ``commit`` the offsets of everything applied are committed first, then close."""
        self._commit_on_stop = commit
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("update consumer %s did not stop within %.1fs", self.group, timeout)
        self.stall.stop()
        self.log_watch.stop()

    def follow(self, models: Sequence[str]) -> None:
        """Consume the update topics of exactly ``models`` from now on (models registered or unloaded at runtime).

        A new model's partitions start at this group's committed offsets; an unloaded model's stop being read,
        with their offsets committed up to what was applied, so loading it again resumes where it stopped
        instead of dead-lettering its updates while it is away. The consumer thread makes the change.
        """
        self.metrics.expect(models)
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
            errors=self.errors,
            stall=self.stall.snapshot(),
            caught_up=self.caught_up(),
            catching_up_partitions=len(self.catch_up.targets),
            oldest_unapplied_s=max(self.catch_up.unapplied_age.values(), default=0.0),
            lost_partitions={f"{t}[{p}]": x.describe() for (t, p), x in sorted(self.lost().items())},
            positions_stored=self.engine.stores_positions,
            **self.gaps.stats(),
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
        backoff = 0.1
        try:
            while not self._stopping.is_set():
                try:
                    self._poll_once()
                    backoff = 0.1
                except Exception as exc:  # noqa: BLE001  (survive anything: read again what was not applied)
                    self.errors += 1
                    self.last_error = f"unexpected error, batch read again: {exc!r}"
                    log.exception("update consumer %s: unexpected error; reading again from what was applied, "
                                  "in %.1fs", self.group, backoff)
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    try:
                        self._reassign(self._positions())
                    except KafkaException as again:  # the next round's error says more
                        log.warning("update consumer %s: cannot read again yet: %s", self.group, again)
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
        self._dlq = DeadLetters(self._client_config, on_error=self._on_dead_letter_error)
        self._ready.set()
        log.info(
            "update consumer %s assigned %d partitions of %s",
            self.group, len(assignment), ", ".join(sorted(self.topics)),
        )

    def _starting_positions(self, consumer: Consumer, topics: list[str]) -> list[TopicPartition]:
        """The partitions of ``topics`` (created if missing, with their DLQs), each at the position stored with the
        rows, or the log's start where the store holds none; partitions that lost updates are left out."""
        admin = AdminClient(self._client_config)
        partitions: dict[str, int] = {}
        for topic in topics:
            partitions[topic] = n = ensure_topic(admin, topic, self.partitions, **self._replication)
            self.topic_partitions[topic] = n
            if n != self.partitions and self.shards > 1:
                raise FailedPreconditionError(
                    f"topic {topic} has {n} partitions but cluster.partitions is {self.partitions}: a shard owns "
                    f"partition % {self.shards} == {self.shard}, so every update topic must have exactly P partitions"
                )
            ensure_topic(admin, dlq_topic_name(topic), 1, **self._replication)
        stored = self.engine.positions()
        keys = [(t, p) for t, count in partitions.items() for p in self.assigned_partitions(t, count)]
        # where this consumer stopped applying a topic it follows again, else the stored position
        return self._plan({k: max(stored.get(k, -1), self._applied.get(k, -1)) for k in keys})

    def _plan(self, wanted: dict[tuple[str, int], int]) -> list[TopicPartition]:
        """Where each partition of ``wanted`` (partition -> the next offset its rows need; negative: none stored)
        starts, after checking it against its log's start and topic id (see watermarks); notes each one's end to
        catch up to. Returns the assignment; partitions that lost updates are stopped instead."""
        keys = list(wanted)
        highs, lows = self.logs.ends(keys), self.logs.starts(keys)  # one ListOffsets request each
        missing = [k for k in keys if k not in highs or k not in lows]
        if missing:
            raise UnavailableError(f"the broker did not answer the offsets of {len(missing)} partition(s), e.g. "
                                   f"{missing[0][0]}[{missing[0][1]}]")
        ids = self.logs.topic_ids({t for t, _ in keys})
        known = {t: self.ledger.topic_id(t) for t in ids}
        recorded = self.ledger.lost({t for t, _ in keys})
        assignment, losses, unpositioned = [], [], {}
        for key, start in wanted.items():
            LOG_GAPS.labels(key[0], str(key[1]))  # at 0 from the first assignment on
            recreated = known.get(key[0]) not in (None, ids.get(key[0]))
            lost = recorded.get(key) or check_start(key, start, lows[key], recreated)
            if lost is not None:
                losses.append(lost)
                continue
            begin = start if start >= 0 and not recreated else lows[key]
            if start < 0 or recreated:
                unpositioned[key] = begin
            self.catch_up.assigned(key, begin, highs[key])
            assignment.append(TopicPartition(key[0], key[1], begin))
            self._start_offsets[key] = begin
            self.gaps.expect(key, begin)
        self._lose(losses)
        for topic, topic_id in ids.items():  # after the losses are recorded: a crash in between finds them again
            self.ledger.set_topic_id(topic, topic_id)
        if unpositioned and self.engine.stores_positions:  # stored from now on, so a later loss is found
            self.engine.apply_changes([], unpositioned)
        if late := {k: o for k, o in unpositioned.items() if o > 0}:
            log.warning("update consumer %s: no position stored for %s; starting at the log's start: the updates "
                        "before it were deleted from the log before this replica read them", self.group,
                        ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(late.items())))
        if assignment:
            log.info("update consumer %s: %d partition(s) of %s start at their stored positions or the log's "
                     "start; %d to catch up", self.group, len(assignment), ", ".join(sorted({t for t, _ in keys})),
                     len(self.catch_up.targets))
        return assignment

    def assigned_partitions(self, topic: str, count: int) -> list[int]:
        """The partitions of ``topic`` (``count`` of them) this consumer reads: its shard's, p % shards == shard."""
        return [p for p in range(count) if p % self.shards == self.shard]

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
            self.catch_up.forget([(tp.topic, tp.partition) for tp in gone])
            self.gaps.forget((tp.topic, tp.partition) for tp in gone)
            self._lost = {p: x for p, x in self._lost.items() if p[0] not in dropped}  # the ledger keeps them
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
        self._take_losses(self.log_watch.take())
        if self._recovering:
            self._recover()
        msgs = self._next_batch()
        if msgs:
            self.stall.received()
            self._process(msgs)
        self._dlq.poll()
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
        groups: dict[tuple[str, str], TableBatch] = {}
        purges: dict[tuple[str, str], int] = {}
        produced_at: dict[str, list[int]] = {}  # per model
        offsets: dict[tuple[str, int], int] = {}  # per partition, the next offset once this batch is applied
        first: dict[tuple[str, int], int] = {}  # per partition, its first offset in this batch
        park: dict[tuple[str, int], int] = {}
        reread: dict[tuple[str, int], int] = {}  # per partition, where a gap begins: read again from there
        loaded = {m.name for m in self.engine.models()}
        assert self._dlq is not None
        dead_letters = self._dlq.sent
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._AUTO_OFFSET_RESET and msg.topic() in self.topics:
                    self._out_of_range((msg.topic(), msg.partition()))
                elif err.code() != KafkaError._PARTITION_EOF:
                    self.last_error = err.str()
                    log.warning("update consumer %s: %s", self.group, err.str())
                continue
            topic = msg.topic()
            part = (topic, msg.partition())
            model = self.topics.get(topic)
            if model is None or part in self._parked or part in park or part in reread:
                continue  # fetched before its partition was dropped, parked or sought back: read again from there
            gap = self.gaps.check(part, msg.offset())
            if gap is not None:
                reread[part] = gap
                continue
            self.gaps.taken(part, msg.offset())
            first.setdefault(part, msg.offset())
            try:
                if model not in loaded:
                    raise ModelUnloadedError(model)
                upd = self._validated(model, msg.value())
                self.admin_messages.check(model, upd, msg.value(), msg.headers())
            except ModelUnloadedError:
                park[part] = msg.offset()
                continue
            except MalformedUpdateError as exc:
                self._dead_letter(msg, model, str(exc))
            else:
                if upd.purge_tombstones_below:
                    purges[(model, upd.table)] = max(purges.get((model, upd.table), 0), upd.purge_tombstones_below)
                else:
                    groups.setdefault((model, upd.table), TableBatch()).add(upd, msg)
                produced_at.setdefault(model, []).append(upd.produced_at_ns)
            offsets[part] = msg.offset() + 1
        done = _Applied()
        changes = self._changes(groups, done)
        if self._dlq.sent != dead_letters and not self._dlq.delivered(self._stopping):
            return  # stopping: the batch is read again, its dead letters produced again
        applied = self._apply(changes, {p: o for p, o in offsets.items() if p not in park}, purges, done)
        if applied is None:
            return  # stopping with this batch unapplied: its positions stay unstored and it is read again
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
        fetched = {k: self._fetched_high(k) for k in offsets}
        with self._applied_cond:
            self._applied.update(offsets)
            self.catch_up.advance(offsets, fetched)
        if park:
            self._park(park)
        for (topic, partition), offset in reread.items():
            if (topic, partition) not in park:
                self._consumer.seek(TopicPartition(topic, partition, offset))

    def _park(self, parts: dict[tuple[str, int], int]) -> None:
        """Stop reading ``parts`` at the given offsets (their model is not loaded) until it is loaded again."""
        assert self._consumer is not None
        gone = [TopicPartition(t, p) for t, p in parts]
        self._consumer.incremental_unassign(gone)
        self._assignment = [tp for tp in self._assignment if (tp.topic, tp.partition) not in parts]
        self._parked.update(parts)
        self.catch_up.forget(list(parts))
        self.gaps.forget(parts)
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
        for part, offset in back.items():
            self.gaps.expect(part, offset)
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

    def _changes(self, groups: dict[tuple[str, str], TableBatch], done: _Applied) -> list[TableChange]:
        """One change per table. A change the engine refuses is checked message by message, and only the messages
        it refuses on their own are dead-lettered; a table whose model is not loaded is left out (``done``)."""
        changes = []
        for (model, table), batch in groups.items():
            try:
                change = self._change(model, table, [batch])
                self.engine.check_change(change)
            except ModelUnloadedError:
                done.unloaded.add(model)
                continue
            except (InvalidArgumentError, MalformedUpdateError, NotFoundError) as exc:
                kept = []
                for msg in batch.messages:
                    single = TableBatch()
                    single.add(decode_update(msg.value()), msg)
                    try:
                        self.engine.check_change(self._change(model, table, [single]))
                        kept.append(single)
                    except ModelUnloadedError:
                        done.unloaded.add(model)
                        break
                    except (InvalidArgumentError, MalformedUpdateError, NotFoundError) as one:
                        self._dead_letter(msg, model, f"rejected by the engine: {one if len(batch.messages) > 1 else exc}")
                if model in done.unloaded or not kept:
                    continue
                change = self._change(model, table, kept)
            changes.append(change)
        return changes

    def _change(self, model: str, table: str, batches: list[TableBatch]) -> TableChange:
        return table_change(model, table, batches, self._table_dim(model, table))

    def _apply(self, changes: list[TableChange], positions: dict[tuple[str, int], int],
               purges: dict[tuple[str, str], int], done: _Applied) -> _Applied | None:
        """Write the changes and the positions they bring the partitions to in one atomic engine call (purges run
        between the rows and the positions); retry transient failures until done (None if stopping first). The
        changes, purges and positions of a model unloaded meanwhile are left for when it is back (``done``)."""
        backoff = 0.05
        while True:
            changes = [c for c in changes if c.model not in done.unloaded]
            purges = {k: v for k, v in purges.items() if k[0] not in done.unloaded}
            positions = {p: o for p, o in positions.items() if self.topics.get(p[0]) not in done.unloaded}
            try:
                if purges:
                    self.engine.apply_changes(changes)
                    for (model, table), below in purges.items():
                        self.engine.purge_tombstones(model, table, below)
                    self.engine.apply_changes([], positions)
                else:
                    self.engine.apply_changes(changes, positions)
                break
            except (NotFoundError, InvalidArgumentError) as exc:
                # validated a moment ago: a model was unloaded or replaced meanwhile; its partitions are parked at
                # this batch and read again (and checked again) once it is loaded
                loaded = {m.name for m in self.engine.models()}
                gone = {c.model for c in changes} | {m for m, _ in purges}
                if not gone:
                    raise
                done.unloaded |= (gone - loaded) or gone
                log.warning("update consumer %s: %s changed under a batch (%s); reading it again", self.group,
                            ", ".join(sorted(gone)), exc)
            except Exception as exc:  # noqa: BLE001  (a tier is down: retry the same rows, store nothing)
                self.metrics.apply_failures += 1
                tables = ", ".join(f"{c.model}.{c.table}" for c in changes) or "positions"
                self.last_error = self.apply_error = f"apply to {tables} failed: {exc}"
                log.warning("update consumer %s: %s; retrying in %.2fs", self.group, self.last_error, backoff)
                if self._stopping.wait(backoff):
                    return None
                backoff = min(backoff * 2, 2.0)
        self.apply_error = None
        for c in changes:
            top = max(int(c.versions.max()) if c.versions.shape[0] else -1,
                      int(c.delete_versions.max()) if c.delete_versions.shape[0] else -1)
            self.metrics.record_applied(
                c.model, c.table,
                rows=int(np.unique(np.concatenate((c.keys, c.delete_keys))).shape[0]),
                received=int(c.keys.shape[0] + c.delete_keys.shape[0]),
                max_version=top if top >= 0 else None,
            )
        return done

    # ---- dead letters, lag --------------------------------------------------------------------
    def _dead_letter(self, msg: Message, model: str, reason: str) -> None:
        assert self._dlq is not None
        self.metrics.record_malformed(model)
        log.warning(
            "update consumer %s: malformed message %s[%d]@%d: %s",
            self.group, msg.topic(), msg.partition(), msg.offset(), reason,
        )
        self._dlq.send(msg, reason)

    def _on_dead_letter_error(self, text: str) -> None:
        self.last_error = text

    def _on_client_error(self, err: KafkaError) -> None:
        self.last_error = err.str()
        log.debug("update consumer %s: client error %s", self.group, err.str())

    def _refresh_consumer_lag(self) -> None:
        """Messages behind per partition and the age of the oldest unapplied update (:meth:`CatchUp.refresh`), from
        the high watermarks of the fetch responses; a partition whose position is past its log's end is handled."""
        positions = self._positions()
        highs = {k: self._fetched_high(k) for k in positions}
        highs = {k: h for k, h in highs.items() if h >= 0}
        beyond = self._beyond_end(highs, positions)
        highs = {k: h for k, h in highs.items() if k not in beyond}
        for (topic, partition), high in highs.items():
            self.metrics.record_consumer_lag(topic, partition, high - positions[(topic, partition)])
        for model, (oldest, behind) in self.catch_up.refresh(highs, positions, self.topics).items():
            log.warning("update consumer %s: the oldest unapplied update of %s is %.0f s old (updates.max_lag_s=%g); "
                        "not ready until %d partition(s) catch up", self.group, model, oldest, self.catch_up.max_lag_s,
                        behind)

    def _fetched_high(self, part: tuple[str, int]) -> int:
        """The high watermark of the latest fetch response of ``part`` (negative while there is none)."""
        try:
            return self._consumer.get_watermark_offsets(TopicPartition(*part), cached=True)[1]
        except KafkaException:
            return -1

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
