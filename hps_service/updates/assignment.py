"""Which partitions an update consumer reads, and from where: its shard's partitions of the topics it follows, each
at the position stored with the rows (checked against its log for lost updates, see :mod:`watermarks`); the
changes :meth:`Assignment.request` asks for (models followed or dropped at runtime); and partitions *parked* at the
first message whose model is not loaded, until it is loaded again.

Everything but :meth:`Assignment.request` runs in the consumer thread, on its Kafka consumer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from hps_service.engine.api import Engine
from hps_service.errors import FailedPreconditionError, UnavailableError
from hps_service.updates.gaps import OffsetGaps
from hps_service.updates.message import dlq_topic_name
from hps_service.updates.metrics import FreshnessStats
from hps_service.updates.progress import Progress
from hps_service.updates.topics import Replication, ensure_topic
from hps_service.updates.watermarks import LOG_GAPS, BrokerLogs, LogLedger, LostLog, check_start

log = logging.getLogger(__name__)

Partition = tuple[str, int]


class Assignment:
    """The partitions read, the topics followed and the partitions parked (see the module docstring)."""

    def __init__(
        self,
        topics: dict[str, str],
        *,
        group: str,
        partitions: int,
        shards: int,
        shard: int,
        client_config: dict[str, Any],
        replication: Replication,
        engine: Engine,
        logs: BrokerLogs,
        ledger: LogLedger,
        progress: Progress,
        gaps: OffsetGaps,
        metrics: FreshnessStats,
        lose: Callable[[list[LostLog]], None],
        forget_lost: Callable[[Collection[str]], None],
        on_error: Callable[[str], None],
    ) -> None:
        """``topics``: update topic -> model; ``lose`` stops partitions that lost updates, ``forget_lost`` forgets
        those of dropped topics, ``on_error`` hears why a change failed."""
        #: Update topic -> model, of the models followed (replaced, never changed in place: stats() reads it).
        self.topics = topics
        #: Partition count of each update topic as the broker reported it.
        self.topic_partitions: dict[str, int] = {}
        #: The partitions assigned to the Kafka consumer now.
        self.assigned: list[TopicPartition] = []
        #: Partitions parked at the offset of the first message whose model was not loaded.
        self.parked: dict[Partition, int] = {}
        #: Guards ``wanted`` (and the consumer's requests to resume lost partitions).
        self.follow_lock = threading.Lock()
        self.wanted: dict[str, str] | None = None  # topics asked for by follow(), not yet (re)assigned
        self.follow_retry_at = 0.0
        self.group = group
        self.partitions = partitions
        self.shards = shards
        self.shard = shard
        self._client_config = client_config
        self._replication = replication
        self.engine = engine
        self.logs = logs
        self.ledger = ledger
        self.progress = progress
        self.catch_up = progress.catch_up
        self.gaps = gaps
        self.metrics = metrics
        self._lose = lose
        self._forget_lost = forget_lost
        self._on_error = on_error

    def request(self, wanted: dict[str, str]) -> None:
        """Follow exactly the topics of ``wanted`` (topic -> model) from now on: the consumer thread makes it so."""
        with self.follow_lock:
            self.wanted = wanted

    def follow_due(self) -> bool:
        """Whether a change :meth:`request` asked for is waiting (and not backing off from a failure)."""
        return self.wanted is not None and time.monotonic() >= self.follow_retry_at

    def starting_positions(self, topics: list[str]) -> list[TopicPartition]:
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
        return self.plan({k: max(stored.get(k, -1), self.progress.applied.get(k, -1)) for k in keys})

    def plan(self, wanted: dict[Partition, int]) -> list[TopicPartition]:
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
            self.progress.start_offsets[key] = begin
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

    def topics_of(self, model: str | None) -> set[str]:
        """The update topics of ``model`` followed now (of every model with None)."""
        return set(self.topics) if model is None else {t for t, m in self.topics.items() if m == model}

    def positions(self) -> dict[Partition, int]:
        """The next offset of each partition read now (applied, or where it was assigned)."""
        return self.progress.positions(self.assigned)

    def reassign(self, consumer: Consumer | None, offsets: dict[Partition, int]) -> None:
        """Read ``offsets`` again from there (assigned again: a partition stopped by a fetch error needs it)."""
        if offsets and consumer is not None:
            consumer.incremental_unassign([TopicPartition(t, p) for t, p in offsets])
            consumer.incremental_assign([TopicPartition(t, p, o) for (t, p), o in offsets.items()])
        for part, offset in offsets.items():
            self.gaps.expect(part, offset)

    def assigned_partitions(self, topic: str, count: int) -> list[int]:
        """The partitions of ``topic`` (``count`` of them) this consumer reads: its shard's, p % shards == shard."""
        return [p for p in range(count) if p % self.shards == self.shard]

    def follow_changes(self, consumer: Consumer) -> None:
        """Assign the partitions of models follow() added and unassign those of models it dropped."""
        with self.follow_lock:
            wanted, self.wanted = self.wanted, None
        if wanted is None:
            return
        dropped = [t for t in self.topics if t not in wanted]
        added = [t for t in wanted if t not in self.topics]
        if dropped:
            gone = [tp for tp in self.assigned if tp.topic in dropped]
            consumer.incremental_unassign(gone)
            gone += [TopicPartition(t, p) for t, p in list(self.parked) if t in dropped]
            self.parked = {tp: o for tp, o in self.parked.items() if tp[0] not in dropped}
            self.assigned = [tp for tp in self.assigned if tp.topic not in dropped]
            self.topics = {t: m for t, m in self.topics.items() if t not in dropped}  # replaced: stats() reads it
            self.metrics.forget_partitions([(tp.topic, tp.partition) for tp in gone])
            self.catch_up.forget([(tp.topic, tp.partition) for tp in gone])
            self.gaps.forget((tp.topic, tp.partition) for tp in gone)
            self._forget_lost(dropped)  # the ledger keeps them
        if added:
            try:
                assignment = self.starting_positions(added)
                consumer.incremental_assign(assignment)
            except (UnavailableError, FailedPreconditionError, KafkaException) as exc:
                error = f"cannot start consuming {', '.join(added)}: {exc}"
                self._on_error(error)
                log.warning("update consumer %s: %s; retrying", self.group, error)
                with self.follow_lock:
                    if self.wanted is None:
                        self.wanted = wanted
                self.follow_retry_at = time.monotonic() + 1.0
                return
            self.assigned.extend(assignment)
            self.topics = {**self.topics, **{t: wanted[t] for t in added}}
        log.info("update consumer %s now follows %s", self.group, ", ".join(sorted(self.topics)) or "no model")

    def park(self, consumer: Consumer, parts: dict[Partition, int]) -> None:
        """Stop reading ``parts`` at the given offsets (their model is not loaded) until it is loaded again."""
        gone = [TopicPartition(t, p) for t, p in parts]
        consumer.incremental_unassign(gone)
        self.assigned = [tp for tp in self.assigned if (tp.topic, tp.partition) not in parts]
        self.parked.update(parts)
        self.catch_up.forget(list(parts))
        self.gaps.forget(parts)
        log.warning("update consumer %s: model %s is not loaded; %s parked until it is", self.group,
                    ", ".join(sorted({self.topics.get(t, t) for t, _ in parts})),
                    ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(parts.items())))

    def resume_parked(self, consumer: Consumer) -> None:
        """Assign again, at their parked offsets, the parked partitions whose model is loaded now."""
        loaded = {m.name for m in self.engine.models()}
        back = {part: o for part, o in self.parked.items() if self.topics.get(part[0]) in loaded}
        if not back:
            return
        assignment = [TopicPartition(t, p, o) for (t, p), o in back.items()]
        consumer.incremental_assign(assignment)
        self.assigned.extend(TopicPartition(t, p) for t, p in back)
        for part, offset in back.items():
            self.gaps.expect(part, offset)
        self.parked = {part: o for part, o in self.parked.items() if part not in back}
        log.info("update consumer %s: resumed %s", self.group,
                 ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(back.items())))
