"""OffsetCommits on its own, over stand-ins for the Kafka consumer and the dead-letter producer: what it commits,
when it holds back, and what the group's confirmations leave as committed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from hps_service.updates.catch_up import CatchUp
from hps_service.updates.commits import OffsetCommits
from hps_service.updates.metrics import FreshnessStats
from hps_service.updates.progress import Progress


class Consumer:
    """Records the commits asked of it; ``fail`` makes commit() raise as librdkafka does."""

    def __init__(self, fail: bool = False) -> None:
        self.commits: list[list[tuple[str, int, int]]] = []
        self.fail = fail

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        if self.fail:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        self.commits.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])


class DeadLetters:
    """Dead letters the broker acknowledged (``landed``) or not."""

    def __init__(self, landed: bool = True) -> None:
        self.landed = landed

    def flush(self, timeout_s: float) -> bool:
        return self.landed


@dataclass
class Confirmed:
    """A partition of the group's answer to a commit (what ``on_commit`` reads of a TopicPartition)."""

    topic: str
    partition: int
    offset: int
    error: Any = None


@dataclass
class Committing:
    commits: OffsetCommits
    progress: Progress
    metrics: FreshnessStats
    errors: list[str]


def committing(applied: dict[tuple[str, int], int]) -> Committing:
    progress, metrics, errors = Progress(CatchUp(60.0)), FreshnessStats(), []
    progress.applied.update(applied)
    return Committing(OffsetCommits("g", progress, metrics, on_error=errors.append), progress, metrics, errors)


def test_commits_only_the_applied_offsets_ahead_of_the_confirmed_ones() -> None:
    c = committing({("t", 0): 10, ("t", 1): 5})
    consumer = Consumer()
    c.commits.on_commit(None, [Confirmed("t", 1, 5)])
    c.commits.commit(consumer, DeadLetters())
    assert consumer.commits == [[("t", 0, 10)]]


def test_holds_back_while_dead_letters_are_unacknowledged_or_a_commit_is_in_flight() -> None:
    c = committing({("t", 0): 10})
    consumer = Consumer()
    c.commits.commit(consumer, DeadLetters(landed=False))
    assert consumer.commits == []  # committing past an unacknowledged dead letter could lose it
    c.commits.commit(consumer, DeadLetters())
    c.commits.commit(consumer, DeadLetters())  # the first one is not confirmed yet
    assert consumer.commits == [[("t", 0, 10)]]
    c.commits.on_commit(None, [Confirmed("t", 0, 10)])
    c.progress.applied[("t", 0)] = 12
    c.commits.commit(consumer, DeadLetters())
    assert consumer.commits == [[("t", 0, 10)], [("t", 0, 12)]]


def test_a_confirmation_keeps_the_highest_offset_and_skips_failed_partitions() -> None:
    c = committing({})
    c.commits.on_commit(None, [Confirmed("t", 0, 10)])
    c.commits.on_commit(None, [Confirmed("t", 0, 7), Confirmed("t", 1, -1001)])  # an older answer; no offset
    c.commits.on_commit(None, [Confirmed("t", 2, 4, error=KafkaError(KafkaError._TRANSPORT))])
    assert c.commits.committed == {("t", 0): 10}
    assert c.errors == []


def test_a_failed_commit_is_counted_and_reported() -> None:
    c = committing({("t", 0): 3})
    c.commits.commit(Consumer(fail=True), DeadLetters())
    c.commits.on_commit(KafkaError(KafkaError._TRANSPORT), [])
    assert c.metrics.commit_failures == 2
    assert len(c.errors) == 2 and all(e.startswith("commit failed: ") for e in c.errors)
    assert c.commits.committed == {}
