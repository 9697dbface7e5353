"""The update consumer's side of lost updates (:mod:`hps_service.updates.watermarks`): partitions stopped for lost
updates, the readiness reason naming them, offsets out of range, positions past a log's end, and resuming partitions
bootstrapped again.

:class:`LogLosses` is built by :class:`hps_service.updates.consumer.UpdateConsumer`; everything here runs in the
consumer thread, on its Kafka consumer, except the readers and :meth:`LogLosses.recover`, which only leaves a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from confluent_kafka import Consumer, TopicPartition

from hps_service.engine.api import Engine
from hps_service.updates.assignment import Assignment
from hps_service.updates.gaps import OffsetGaps
from hps_service.updates.metrics import FreshnessStats
from hps_service.updates.progress import Progress
from hps_service.updates.watermarks import (
    BELOW_START,
    LOG_GAPS,
    RECREATED,
    BrokerLogs,
    LogLedger,
    LostLog,
    find_losses,
)

log = logging.getLogger(__name__)

Partition = tuple[str, int]


class LogLosses:
    """The partitions an update consumer stopped for lost updates (see the module docstring)."""

    def __init__(self, *, group: str, engine: Engine, metrics: FreshnessStats, logs: BrokerLogs,
                 ledger: LogLedger, progress: Progress, gaps: OffsetGaps, assignment: Assignment,
                 kafka: Callable[[], Consumer | None]) -> None:
        """``kafka``: the consumer thread's Kafka consumer now (None while it is not connected)."""
        self.group = group
        self._engine = engine
        self._metrics = metrics
        self._logs = logs
        self._ledger = ledger
        self._progress = progress
        self._catch_up = progress.catch_up
        self._gaps = gaps
        self._assignment = assignment
        self._kafka = kafka
        #: The partitions stopped for lost updates (the ledger keeps them durably).
        self._lost: dict[Partition, LostLog] = {}
        #: Lost partitions bootstrapped again, to resume at these positions (:meth:`recover`).
        self._recovering: dict[Partition, int] = {}
        #: Partitions seen past their end once, at that position.
        self._past_end_seen: dict[Partition, int] = {}

    # ---- readers ------------------------------------------------------------------------------
    def lost(self, model: str | None = None) -> dict[Partition, LostLog]:
        """The partitions of ``model`` (of every model with None) that lost updates and are stopped."""
        topics = self._assignment.topics_of(model)
        return {p: x for p, x in dict(self._lost).items() if p[0] in topics}

    def lost_reason(self, model: str | None = None) -> str | None:
        """Why ``model`` must not be served for lost updates (naming the partitions), or None."""
        lost = sorted(self.lost(model).values(), key=lambda x: x.part)
        if not lost:
            return None
        named = "; ".join(x.describe() for x in lost[:4]) + (f"; and {len(lost) - 4} more" if len(lost) > 4 else "")
        return (f"lost updates on {len(lost)} partition(s): {named}; nothing more of them is applied until they are "
                f"bootstrapped again from a snapshot the log can be replayed from")

    def recover(self, positions: dict[Partition, int]) -> None:
        """Lost partitions whose rows were bootstrapped again up to ``positions``: the consumer thread stores the
        positions and resumes them there."""
        with self._assignment.follow_lock:
            self._recovering.update(positions)

    # ---- the consumer thread ------------------------------------------------------------------
    def take(self, found: list[LostLog]) -> None:
        """Losses the log watch found: those of partitions still where they were found (the others moved since
        and are checked again)."""
        if found:
            now = self._assignment.positions()
            self.lose([x for x in found if now.get(x.part) == x.position])

    def beyond_end(self, highs: dict[Partition, int], positions: dict[Partition, int]) -> set[Partition]:
        """Partitions whose position is past the high watermark of their fetch responses on two refreshes in a row
        at the same position (a watermark cached from before the partition was last assigned is not taken for
        one); each is handled (:meth:`_past_end`). Returns them."""
        suspects = {p: positions[p] for p, high in highs.items() if 0 <= high < positions[p]}
        confirmed = {p for p, o in suspects.items() if self._past_end_seen.get(p) == o}
        self._past_end_seen = {p: o for p, o in suspects.items() if p not in confirmed}
        for part in confirmed:
            self._past_end(part, positions[part], highs[part])
        return set(suspects)

    def lose(self, losses: list[LostLog]) -> None:
        """Stop partitions that lost updates (recorded durably first) and say so: ERROR log, metric, readiness."""
        losses = [x for x in losses if x.part not in self._lost and x.topic in self._assignment.topics]
        if not losses:
            return
        self._ledger.mark_lost(losses)
        for x in losses:
            if x.reason == RECREATED and x.topic_id is not None:  # the other partitions read the new topic now
                self._ledger.set_topic_id(x.topic, x.topic_id)
        parts = {x.part for x in losses}
        gone = [tp for tp in self._assignment.assigned if (tp.topic, tp.partition) in parts]
        kafka = self._kafka()
        if gone and kafka is not None:
            kafka.incremental_unassign(gone)
        self._assignment.assigned = [tp for tp in self._assignment.assigned if (tp.topic, tp.partition) not in parts]
        self._assignment.parked = {p: o for p, o in self._assignment.parked.items() if p not in parts}
        self._catch_up.forget(parts)
        self._gaps.forget(parts)
        self._metrics.forget_partitions(list(parts))  # no lag figure for a partition nobody reads
        for x in losses:
            self._lost[x.part] = x
            LOG_GAPS.labels(x.topic, str(x.partition)).inc()
            log.error("update consumer %s: lost updates on %s; nothing more of the partition is applied and the "
                      "replica is not ready until it is bootstrapped again from a snapshot the log can be replayed "
                      "from", self.group, x.describe())

    def forget(self, topics: Collection[str]) -> None:
        """Partitions of ``topics`` (no longer followed) are no longer reported as lost; the ledger keeps them."""
        self._lost = {p: x for p, x in self._lost.items() if p[0] not in topics}

    def out_of_range(self, part: Partition) -> None:
        """A fetch found the partition's offset out of its log: below its start (lost) or past its end."""
        position = self._assignment.positions().get(part)
        if position is None:
            return
        found = find_losses(self._logs, self._ledger, lambda: {part: position}, {part[0]})
        if found:
            self.lose(found)
            return
        high = self._logs.ends([part]).get(part, -1)
        if 0 <= high < position:
            self._past_end(part, position, high)
        else:  # back in range (or the broker did not answer): read on from there
            self._assignment.reassign(self._kafka(), {part: position})

    def _past_end(self, part: Partition, position: int, high: int) -> None:
        """The partition stands past its log's end: another topic of that name (lost, see watermarks), or the same
        one, which lost records: read again from its start (versions make that harmless)."""
        found = find_losses(self._logs, self._ledger, lambda: {part: position}, {part[0]})
        if any(x.reason != BELOW_START for x in found):
            self.lose(found)
            return
        begin = self._logs.starts([part]).get(part, 0)
        log.warning("update consumer %s: %s[%d] stands at offset %d but its log ends at %d; reading it again from "
                    "offset %d", self.group, part[0], part[1], position, high, begin)
        with self._progress.cond:
            self._progress.applied.pop(part, None)
        self._progress.start_offsets[part] = begin
        self._catch_up.assigned(part, begin, high)
        self._assignment.reassign(self._kafka(), {part: begin})

    def resume_recovered(self) -> None:
        """Resume lost partitions bootstrapped again (:meth:`recover`) at the positions their rows stand at now."""
        if not self._recovering:
            return
        with self._assignment.follow_lock:
            todo, self._recovering = {p: o for p, o in self._recovering.items() if p in self._lost}, {}
        kafka = self._kafka()
        if not todo or kafka is None:
            return
        self._engine.apply_changes([], todo)
        self._ledger.recovered(list(todo))
        with self._progress.cond:
            for part in todo:
                self._lost.pop(part, None)
                self._progress.applied.pop(part, None)
        assignment = self._assignment.plan(todo)
        kafka.incremental_assign(assignment)
        self._assignment.assigned.extend(TopicPartition(tp.topic, tp.partition) for tp in assignment)
        log.info("update consumer %s: bootstrapped again, resumed %s", self.group,
                 ", ".join(f"{tp.topic}[{tp.partition}]@{tp.offset}" for tp in assignment))
