"""The update consumer's offset commits to its consumer group: after the apply, for lag monitoring (positions that
count are stored with the rows), and never past a dead letter the broker has not acknowledged.

:class:`OffsetCommits` is built by :class:`hps_service.updates.consumer.UpdateConsumer` and run in its thread, on its
Kafka consumer and dead-letter producer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from hps_service.updates.dead_letters import DeadLetters
from hps_service.updates.metrics import FreshnessStats
from hps_service.updates.progress import Progress

log = logging.getLogger(__name__)

Partition = tuple[str, int]


class OffsetCommits:
    """Commits of the applied offsets (see the module docstring): the offsets the group confirmed, and the commit in
    flight."""

    def __init__(self, group: str, progress: Progress, metrics: FreshnessStats,
                 on_error: Callable[[str], None]) -> None:
        """``progress``: the applied offsets to commit; ``on_error`` hears why a commit failed."""
        self.group = group
        self._progress = progress
        self._metrics = metrics
        self._on_error = on_error
        #: The offset the group confirmed, per partition.
        self.committed: dict[Partition, int] = {}
        #: When the last commit was started (monotonic).
        self.last_commit = 0.0
        self._in_flight_since: float | None = None

    def commit(self, consumer: Consumer, dlq: DeadLetters) -> None:
        """Start an async commit of the applied offsets ahead of the committed ones (once dead letters landed)."""
        self.last_commit = time.monotonic()
        in_flight = self._in_flight_since
        if in_flight is not None and self.last_commit - in_flight < 5.0:
            return
        todo = self._ahead()
        if not todo:
            return
        if not dlq.flush(0):
            return  # dead letters not yet acknowledged: committing past them could lose them
        try:
            self._in_flight_since = self.last_commit
            consumer.commit(offsets=todo, asynchronous=True)
        except KafkaException as exc:
            self._in_flight_since = None
            self._metrics.commit_failures += 1
            error = f"commit failed: {exc}"
            self._on_error(error)
            log.warning("update consumer %s: %s", self.group, error)

    def on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """The Kafka consumer's ``on_commit`` callback: a commit was confirmed (or failed)."""
        self._in_flight_since = None
        if err is not None:
            self._metrics.commit_failures += 1
            self._on_error(f"commit failed: {err}")
            return
        for tp in partitions or []:
            if tp.error is None and tp.offset >= 0:
                key = (tp.topic, tp.partition)
                self.committed[key] = max(self.committed.get(key, -1), tp.offset)

    def final(self, consumer: Consumer, dlq: DeadLetters, assigned: list[TopicPartition], timeout_s: float) -> None:
        """Commit everything applied, waiting at most ``timeout_s`` (a frozen broker must not block stop());
        ``assigned`` is paused first."""
        deadline = time.monotonic() + timeout_s
        consumer.pause(assigned)  # nothing more is fetched while we wait for the commit
        if not dlq.flush(timeout_s / 2):
            log.warning("update consumer %s: dead letters undelivered; offsets left uncommitted", self.group)
            return
        todo = self._ahead()
        if not todo:
            return
        consumer.commit(offsets=todo, asynchronous=True)
        while time.monotonic() < deadline:
            if all(self.committed.get((tp.topic, tp.partition), -1) >= tp.offset for tp in todo):
                return
            consumer.poll(0.05)  # serves the commit callback
        log.warning("update consumer %s: final commit not confirmed within %.1fs", self.group, timeout_s)

    def _ahead(self) -> list[TopicPartition]:
        """The applied offsets ahead of the committed ones."""
        return [TopicPartition(t, p, o) for (t, p), o in self._progress.applied.items()
                if o > self.committed.get((t, p), -1)]
