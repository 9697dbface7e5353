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

This module is the loop; its parts: which partitions are read and from where (:mod:`assignment`), the applied
positions (:mod:`progress`), a batch into durable engine changes (:mod:`apply`), lost updates (:mod:`log_losses`)
and the offset commits (:mod:`commits`), each an object the consumer builds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from hps_service.config import UpdatesConfig
from hps_service.engine.api import Engine
from hps_service.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from hps_service.updates.admin_signature import AdminMessages
from hps_service.updates.apply import BatchApply, ModelUnloadedError
from hps_service.updates.assignment import Assignment
from hps_service.updates.catch_up import CatchUp
from hps_service.updates.commits import OffsetCommits
from hps_service.updates.dead_letters import DeadLetters
from hps_service.updates.gaps import OffsetGaps
from hps_service.updates.kafka_log import KAFKA_LOG, with_logging
from hps_service.updates.log_losses import LogLosses
from hps_service.updates.message import topic_name
from hps_service.updates.metrics import FreshnessStats
from hps_service.updates.progress import Progress
from hps_service.updates.stall import StallDetector
from hps_service.updates.topics import DEFAULT_PARTITIONS
from hps_service.updates.watermarks import BrokerLogs, LogLedger, LogWatch, LostLog

__all__ = ["ModelUnloadedError", "UpdateConsumer"]

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


class UpdateConsumer:
    """Applies the update topics of ``models`` to ``engine`` in a background thread; see the module docstring.

    ``ready`` turns True once every partition is assigned at a known offset, so nothing published afterwards
    can be missed; ``caught_up()`` once what was on the topics then is applied too. ``stop()`` commits what was
    applied and closes. Malformed messages go to ``<topic>.dlq``.
    """

    def __init__(
        self,
        cfg: UpdatesConfig,
        engine: Engine,
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
        self.batch_messages = batch_messages
        self.poll_timeout_s = poll_timeout_s
        self.commit_interval_s = commit_interval_s
        self.close_timeout_s = close_timeout_s
        self.partitions = partitions
        self.shards = shards
        self.shard = shard
        self._client_config = with_logging(
            {**cfg.kafka_config, "bootstrap.servers": cfg.brokers, "socket.nagle.disable": True})
        self.metrics = FreshnessStats()
        self.metrics.expect(models)
        self.admin_messages = AdminMessages(cfg.admin_key)
        self._consumer: Consumer | None = None
        self._dlq: DeadLetters | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._commit_on_stop = True
        #: Catch-up targets, confirmed log ends and lag per partition.
        self.catch_up = CatchUp(cfg.max_lag_s)
        #: The next offset applied and where each partition was assigned.
        self.progress = Progress(self.catch_up)
        #: Where the logs start and end and which topics they are; partitions that lost updates (stopped, durable).
        self.logs = BrokerLogs(self._client_config)
        self.ledger = LogLedger(engine.persistent)
        #: Commits of the applied offsets to the group (for lag monitoring).
        self.commits = OffsetCommits(group, self.progress, self.metrics, on_error=self._on_error)
        self._consumer_config = {
            **_CONSUMER_DEFAULTS,
            **cfg.kafka_config,
            **(consumer_config or {}),
            "bootstrap.servers": cfg.brokers,
            "group.id": group,
            "on_commit": self.commits.on_commit,
            "error_cb": self._on_client_error,
            "logger": KAFKA_LOG,
        }
        self._last_lag_refresh = 0.0
        self.last_error: str | None = None
        #: Unexpected errors the consumer thread survived (each batch then read again from what was applied).
        self.errors = 0
        #: Where each partition's next message must be; a gap is read again before it is skipped.
        self.gaps = OffsetGaps(cfg.offset_gap_recheck_s)
        #: The partitions read, the topics followed, the partitions parked.
        self.assignment = Assignment(
            {topic_name(m, cfg.topic_prefix): m for m in models}, group=group, partitions=partitions, shards=shards,
            shard=shard, client_config=self._client_config,
            replication={"replication_factor": cfg.replication_factor,
                         "min_insync_replicas": cfg.min_insync_replicas},
            engine=engine, logs=self.logs, ledger=self.ledger, progress=self.progress, gaps=self.gaps,
            metrics=self.metrics, lose=lambda found: self.losses.lose(found),
            forget_lost=lambda topics: self.losses.forget(topics), on_error=self._on_error,
        )
        #: Partitions stopped for lost updates, offsets out of range, positions past a log's end.
        self.losses = LogLosses(group=group, engine=engine, metrics=self.metrics, logs=self.logs, ledger=self.ledger,
                                progress=self.progress, gaps=self.gaps, assignment=self.assignment,
                                kafka=lambda: self._consumer)
        self.log_watch = LogWatch(self.logs, self.ledger, self.assignment.positions, cfg.log_check_interval_s, group)
        #: Turns polled batches into engine changes and applies them.
        self.applier = BatchApply(engine, self.metrics, self.admin_messages, self.gaps, group, self._stopping,
                                  on_error=self._on_error)
        #: Flags a stalled stream: messages waiting and none applied for ``cfg.stall_after_s``.
        self.stall = StallDetector(
            cfg.stall_after_s, client_config=self._client_config, name=group,
            applied=lambda: dict(self.progress.applied), starts=lambda: dict(self.progress.start_offsets),
            assigned=lambda: [(tp.topic, tp.partition) for tp in list(self.assignment.assigned)],
        )

    @property
    def topics(self) -> dict[str, str]:
        """Update topic -> model, of the models followed now."""
        return self.assignment.topics

    @property
    def topic_partitions(self) -> dict[str, int]:
        """Partition count of each update topic as the broker reported it."""
        return self.assignment.topic_partitions

    @property
    def apply_error(self) -> str | None:
        """Why the current batch cannot be applied (a tier write fails); None once it is applied."""
        return self.applier.apply_error

    def assigned_partitions(self, topic: str, count: int) -> list[int]:
        """The partitions of ``topic`` (``count`` of them) this consumer reads: its shard's, p % shards == shard."""
        return self.assignment.assigned_partitions(topic, count)

    @property
    def _committed(self) -> dict[tuple[str, int], int]:
        """The offsets the group confirmed, per partition (:attr:`OffsetCommits.committed`)."""
        return self.commits.committed

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
        topics = self.assignment.topics_of(model)
        return self.catch_up.reason({p for p in self.catch_up.targets if p[0] in topics}, self.progress.applied)

    def caught_up(self, model: str | None = None) -> bool:
        """Whether every partition of ``model`` (of every model with None) is applied up to its target."""
        return self.catching_up(model) is None

    def wait_caught_up(self, timeout: float | None = None) -> bool:
        """Block until :meth:`caught_up` (or the timeout); returns it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.progress.cond:
            while not self.caught_up():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self.progress.cond.wait(0.1 if remaining is None else min(remaining, 0.1))
        return True

    def end_offsets(self, model: str) -> dict[tuple[str, int], int]:
        """The end offset of each assigned partition of ``model``, asked of the broker now."""
        if not self.ready:
            raise UnavailableError("the update consumer has no partitions yet")
        keys = [(tp.topic, tp.partition) for tp in list(self.assignment.assigned)
                if self.topics.get(tp.topic) == model]
        out = self.logs.ends(keys)
        if len(out) != len(keys):
            raise UnavailableError(f"the broker did not answer the end offsets of {model}'s partitions")
        return out

    def wait_applied(self, positions: dict[tuple[str, int], int], timeout: float) -> bool:
        """Block until every ``(topic, partition) -> offset`` in ``positions`` is applied (the message at that
        offset included), or the timeout; returns whether it was."""
        return self.progress.wait_applied(positions, timeout)

    def wait_applied_to_end(self, model: str, timeout: float) -> bool:
        """Block until everything on ``model``'s partitions when called is applied, or the timeout; returns whether
        it was (read-your-writes). The broker's listed end may be short (tansu's is a batch short): once applied up
        to it, the end the fetch responses showed by then is waited for too (see :mod:`catch_up`)."""
        if reason := self.lost_reason(model):
            raise UnavailableError(reason)
        deadline = time.monotonic() + timeout
        listed = self.end_offsets(model)
        for _ in range(2):
            ends = {k: self.catch_up.end(k, end) for k, end in listed.items()}
            if not self.wait_applied(
                    {k: end - 1 for k, end in ends.items() if end > 0}, deadline - time.monotonic()):
                return False
        return True

    def lost(self, model: str | None = None) -> dict[tuple[str, int], LostLog]:
        """The partitions of ``model`` (of every model with None) that lost updates and are stopped."""
        return self.losses.lost(model)

    def lost_reason(self, model: str | None = None) -> str | None:
        """Why ``model`` must not be served for lost updates (naming the partitions), or None."""
        return self.losses.lost_reason(model)

    def recover(self, positions: dict[tuple[str, int], int]) -> None:
        """Lost partitions bootstrapped again up to ``positions``: the consumer thread resumes them there."""
        self.losses.recover(positions)

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
        self.assignment.request({topic_name(m, self.cfg.topic_prefix): m for m in models})

    def stats(self) -> dict[str, Any]:
        """Freshness and ingest state for /v1/stats."""
        out = self.metrics.snapshot()
        out.update(
            ready=self.ready,
            group=self.group,
            topics=sorted(self.topics),
            applied_offsets={f"{t}[{p}]": o for (t, p), o in sorted(self.progress.applied.items())},
            committed_offsets={f"{t}[{p}]": o for (t, p), o in sorted(self._committed.items())},
            parked_offsets={f"{t}[{p}]": o for (t, p), o in sorted(dict(self.assignment.parked).items())},
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
                        self.assignment.reassign(self._consumer, self.assignment.positions())
                    except KafkaException as again:  # the next round's error says more
                        log.warning("update consumer %s: cannot read again yet: %s", self.group, again)
        finally:
            self._close_clients(commit=self._commit_on_stop)

    def _connect(self) -> None:
        consumer = Consumer(self._consumer_config)
        try:
            assignment = self.assignment.starting_positions(list(self.topics))
            consumer.assign(assignment)
        except Exception:
            consumer.close()
            raise
        self._consumer = consumer
        self.assignment.assigned = assignment
        self._dlq = DeadLetters(self._client_config, on_error=self._on_error)
        self._ready.set()
        log.info(
            "update consumer %s assigned %d partitions of %s",
            self.group, len(assignment), ", ".join(sorted(self.topics)),
        )

    def _poll_once(self) -> None:
        assert self._consumer is not None and self._dlq is not None
        if self.assignment.follow_due():
            self.assignment.follow_changes(self._consumer)
        if self.assignment.parked:
            self.assignment.resume_parked(self._consumer)
        self.losses.take(self.log_watch.take())
        self.losses.resume_recovered()
        msgs = self._next_batch()
        if msgs:
            self.stall.received()
            self._process(msgs)
        self._dlq.poll()
        now = time.monotonic()
        if now - self.commits.last_commit >= self.commit_interval_s:
            self.commits.commit(self._consumer, self._dlq)
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
        assert self._consumer is not None and self._dlq is not None
        batch = self.applier.read(msgs, self.assignment, self._dlq, self.losses.out_of_range)
        if not self.applier.apply(batch, self.topics, self._dlq):
            return  # stopping: the batch is read again
        fetched = {k: self._fetched_high(k) for k in batch.offsets}
        self.progress.advance(batch.offsets, fetched)
        if batch.park:
            self.assignment.park(self._consumer, batch.park)
        for (topic, partition), offset in batch.reread.items():
            if (topic, partition) not in batch.park:
                self._consumer.seek(TopicPartition(topic, partition, offset))

    # ---- errors, lag --------------------------------------------------------------------------
    def _on_error(self, text: str) -> None:
        self.last_error = text

    def _on_client_error(self, err: KafkaError) -> None:
        self.last_error = err.str()
        log.debug("update consumer %s: client error %s", self.group, err.str())

    def _refresh_consumer_lag(self) -> None:
        """Messages behind per partition and the age of the oldest unapplied update (:meth:`CatchUp.refresh`), from
        the high watermarks of the fetch responses; a partition whose position is past its log's end is handled."""
        positions = self.assignment.positions()
        highs = {k: self._fetched_high(k) for k in positions}
        highs = {k: h for k, h in highs.items() if h >= 0}
        beyond = self.losses.beyond_end(highs, positions)
        highs = {k: h for k, h in highs.items() if k not in beyond}
        for (topic, partition), high in highs.items():
            self.metrics.record_consumer_lag(topic, partition, high - positions[(topic, partition)])
        for model, (oldest, behind) in self.catch_up.refresh(highs, positions, self.topics).items():
            log.warning("update consumer %s: the oldest unapplied update of %s is %.0f s old (updates.max_lag_s=%g); "
                        "not ready until %d partition(s) catch up", self.group, model, oldest, self.catch_up.max_lag_s,
                        behind)

    def _fetched_high(self, part: tuple[str, int]) -> int:
        """The high watermark of the latest fetch response of ``part`` (negative while there is none)."""
        if self._consumer is None:
            return -1
        try:
            return self._consumer.get_watermark_offsets(TopicPartition(*part), cached=True)[1]
        except KafkaException:
            return -1

    def _close_clients(self, commit: bool) -> None:
        if self._consumer is not None:
            if commit:
                assert self._dlq is not None
                try:
                    self.commits.final(self._consumer, self._dlq, self.assignment.assigned, self.close_timeout_s)
                except KafkaException as exc:
                    log.warning("update consumer %s: final commit failed: %s", self.group, exc)
            self._consumer.close()
            self._consumer = None
        if self._dlq is not None:
            self._dlq.flush(self.close_timeout_s / 2)
            self._dlq = None
        self._ready.clear()
