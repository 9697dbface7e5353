"""The update consumer's side of lost updates (:mod:`hps_service.updates.watermarks`): partitions stopped for lost
updates, the readiness reason naming them, offsets out of range, positions past a log's end, resuming partitions
bootstrapped again, and the read-your-writes wait (a log's end as the consumer has read it).

A part of :class:`hps_service.updates.consumer.UpdateConsumer` (a mixin: everything here runs on its state, in its
thread, except the public readers and :meth:`LogLosses.recover`, which only leaves a request).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from confluent_kafka import TopicPartition

from hps_service.errors import UnavailableError
from hps_service.updates.watermarks import BELOW_START, LOG_GAPS, RECREATED, LostLog, find_losses

if TYPE_CHECKING:
    from hps_service.updates.assignment import Assignment
    from hps_service.updates.catch_up import CatchUp
    from hps_service.updates.gaps import OffsetGaps
    from hps_service.updates.progress import Progress
    from hps_service.updates.watermarks import BrokerLogs, LogLedger

log = logging.getLogger(__name__)

Partition = tuple[str, int]


class LogLosses:
    """Lost partitions of an update consumer (see the module docstring)."""

    group: str
    engine: Any
    metrics: Any
    logs: BrokerLogs
    ledger: LogLedger
    catch_up: CatchUp
    gaps: OffsetGaps
    assignment: Assignment
    progress: Progress
    _consumer: Any
    _lost: dict[Partition, LostLog]
    _recovering: dict[Partition, int]
    _past_end_seen: dict[Partition, int]  # partitions seen past their end once, at that position

    if TYPE_CHECKING:  # the consumer's, which this is mixed into

        @property
        def topics(self) -> dict[str, str]: ...

        def end_offsets(self, model: str) -> dict[Partition, int]: ...

        def wait_applied(self, positions: dict[Partition, int], timeout: float) -> bool: ...

    # ---- readers ------------------------------------------------------------------------------
    def lost(self, model: str | None = None) -> dict[Partition, LostLog]:
        """The partitions of ``model`` (of every model with None) that lost updates and are stopped."""
        topics = self.assignment.topics_of(model)
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
        with self.assignment.follow_lock:
            self._recovering.update(positions)

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

    # ---- the consumer thread ------------------------------------------------------------------
    def _take_losses(self, found: list[LostLog]) -> None:
        """Losses the log watch found: those of partitions still where they were found (the others moved since
        and are checked again)."""
        if found:
            now = self.assignment.positions()
            self._lose([x for x in found if now.get(x.part) == x.position])

    def _beyond_end(self, highs: dict[Partition, int], positions: dict[Partition, int]) -> set[Partition]:
        """Partitions whose position is past the high watermark of their fetch responses on two refreshes in a row
        at the same position (a watermark cached from before the partition was last assigned is not taken for
        one); each is handled (:meth:`_past_end`). Returns them."""
        suspects = {p: positions[p] for p, high in highs.items() if 0 <= high < positions[p]}
        confirmed = {p for p, o in suspects.items() if self._past_end_seen.get(p) == o}
        self._past_end_seen = {p: o for p, o in suspects.items() if p not in confirmed}
        for part in confirmed:
            self._past_end(part, positions[part], highs[part])
        return set(suspects)

    def _lose(self, losses: list[LostLog]) -> None:
        """Stop partitions that lost updates (recorded durably first) and say so: ERROR log, metric, readiness."""
        losses = [x for x in losses if x.part not in self._lost and x.topic in self.topics]
        if not losses:
            return
        self.ledger.mark_lost(losses)
        for x in losses:
            if x.reason == RECREATED and x.topic_id is not None:  # the other partitions read the new topic now
                self.ledger.set_topic_id(x.topic, x.topic_id)
        parts = {x.part for x in losses}
        gone = [tp for tp in self.assignment.assigned if (tp.topic, tp.partition) in parts]
        if gone and self._consumer is not None:
            self._consumer.incremental_unassign(gone)
        self.assignment.assigned = [tp for tp in self.assignment.assigned if (tp.topic, tp.partition) not in parts]
        self.assignment.parked = {p: o for p, o in self.assignment.parked.items() if p not in parts}
        self.catch_up.forget(parts)
        self.gaps.forget(parts)
        self.metrics.forget_partitions(list(parts))  # no lag figure for a partition nobody reads
        for x in losses:
            self._lost[x.part] = x
            LOG_GAPS.labels(x.topic, str(x.partition)).inc()
            log.error("update consumer %s: lost updates on %s; nothing more of the partition is applied and the "
                      "replica is not ready until it is bootstrapped again from a snapshot the log can be replayed "
                      "from", self.group, x.describe())

    def _forget_lost(self, topics: Collection[str]) -> None:
        """Partitions of ``topics`` (no longer followed) are no longer reported as lost; the ledger keeps them."""
        self._lost = {p: x for p, x in self._lost.items() if p[0] not in topics}

    def _out_of_range(self, part: Partition) -> None:
        """A fetch found the partition's offset out of its log: below its start (lost) or past its end."""
        position = self.assignment.positions().get(part)
        if position is None:
            return
        found = find_losses(self.logs, self.ledger, lambda: {part: position}, {part[0]})
        if found:
            self._lose(found)
            return
        high = self.logs.ends([part]).get(part, -1)
        if 0 <= high < position:
            self._past_end(part, position, high)
        else:  # back in range (or the broker did not answer): read on from there
            self.assignment.reassign(self._consumer, {part: position})

    def _past_end(self, part: Partition, position: int, high: int) -> None:
        """The partition stands past its log's end: another topic of that name (lost, see watermarks), or the same
        one, which lost records: read again from its start (versions make that harmless)."""
        found = find_losses(self.logs, self.ledger, lambda: {part: position}, {part[0]})
        if any(x.reason != BELOW_START for x in found):
            self._lose(found)
            return
        begin = self.logs.starts([part]).get(part, 0)
        log.warning("update consumer %s: %s[%d] stands at offset %d but its log ends at %d; reading it again from "
                    "offset %d", self.group, part[0], part[1], position, high, begin)
        with self.progress.cond:
            self.progress.applied.pop(part, None)
        self.progress.start_offsets[part] = begin
        self.catch_up.assigned(part, begin, high)
        self.assignment.reassign(self._consumer, {part: begin})

    def _recover(self) -> None:
        """Resume lost partitions bootstrapped again (:meth:`recover`) at the positions their rows stand at now."""
        with self.assignment.follow_lock:
            todo, self._recovering = {p: o for p, o in self._recovering.items() if p in self._lost}, {}
        if not todo or self._consumer is None:
            return
        self.engine.apply_changes([], todo)
        self.ledger.recovered(list(todo))
        with self.progress.cond:
            for part in todo:
                self._lost.pop(part, None)
                self.progress.applied.pop(part, None)
        assignment = self.assignment.plan(todo)
        self._consumer.incremental_assign(assignment)
        self.assignment.assigned.extend(TopicPartition(tp.topic, tp.partition) for tp in assignment)
        log.info("update consumer %s: bootstrapped again, resumed %s", self.group,
                 ", ".join(f"{tp.topic}[{tp.partition}]@{tp.offset}" for tp in assignment))
