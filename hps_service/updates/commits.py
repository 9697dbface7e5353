"""The update consumer's offset commits to its consumer group: after the apply, for lag monitoring (positions that
count are stored with the rows), and never past a dead letter the broker has not acknowledged.

A part of :class:`hps_service.updates.consumer.UpdateConsumer` (a mixin over its state, run in its thread).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

if TYPE_CHECKING:
    from hps_service.updates.assignment import Assignment
    from hps_service.updates.progress import Progress

log = logging.getLogger(__name__)


class OffsetCommits:
    """Commits of an update consumer (see the module docstring)."""

    group: str
    metrics: Any
    last_error: str | None
    _consumer: Any
    _dlq: Any
    assignment: Assignment
    progress: Progress
    _committed: dict[tuple[str, int], int]
    _commit_in_flight_since: float | None
    _last_commit: float

    def _commit(self) -> None:
        """Start an async commit of the applied offsets ahead of the committed ones (once dead letters landed)."""
        assert self._consumer is not None and self._dlq is not None
        self._last_commit = time.monotonic()
        in_flight = self._commit_in_flight_since
        if in_flight is not None and self._last_commit - in_flight < 5.0:
            return
        todo = [TopicPartition(t, p, o) for (t, p), o in self.progress.applied.items()
                if o > self._committed.get((t, p), -1)]
        if not todo:
            return
        if not self._dlq.flush(0):
            return  # dead letters not yet acknowledged: committing past them could lose them
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

    def _final_commit(self, timeout_s: float) -> None:
        """Commit everything applied, waiting at most ``timeout_s`` (a frozen broker must not block stop())."""
        assert self._consumer is not None and self._dlq is not None
        deadline = time.monotonic() + timeout_s
        self._consumer.pause(self.assignment.assigned)  # nothing more is fetched while we wait for the commit
        if not self._dlq.flush(timeout_s / 2):
            log.warning("update consumer %s: dead letters undelivered; offsets left uncommitted", self.group)
            return
        todo = [TopicPartition(t, p, o) for (t, p), o in self.progress.applied.items()
                if o > self._committed.get((t, p), -1)]
        if not todo:
            return
        self._consumer.commit(offsets=todo, asynchronous=True)
        while time.monotonic() < deadline:
            if all(self._committed.get((tp.topic, tp.partition), -1) >= tp.offset for tp in todo):
                return
            self._consumer.poll(0.05)  # serves the commit callback
        log.warning("update consumer %s: final commit not confirmed within %.1fs", self.group, timeout_s)
