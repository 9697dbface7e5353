"""Updates lost from the log, never skipped silently.

A partition has lost updates for this replica when the position its rows were applied up to (stored with them, or
restored from a snapshot) is below the log's start now (retention deleted what the replica had not read: it was
down, or lagging, longer than the retention, or bootstrapped from a snapshot older than it), or when the topic was
deleted and created again after the rows were applied from it (another topic id: the old log's updates after that
position are gone, and the new log's offsets mean other records). The replica then:

* logs an ERROR naming the partition and the offsets it lost, and counts it in ``hps_update_log_gaps_total``;
* applies nothing more of that partition (it is unassigned) and is not ready (``/readyz`` 503 and gRPC health
  NOT_SERVING, for the replica and the model, with a reason naming the partition), until its rows are bootstrapped
  again from a snapshot that the log can be replayed from (``hps_service.fleet.recovery``);
* keeps that state durable (the persistent tier's metadata), so a restart does not forget it.

A partition the store holds no position for starts at the log's start, as an empty store does (with a WARNING when
that start is past offset 0); from then on its position is stored, and travels with snapshots, even while nothing
was applied from it, so that a later loss is found. A position past the log's
end is not a loss: it is read again from the log's start (versions make that harmless), unless the topic id
changed. Checks run when a partition is assigned, when a fetch finds its offset out of range
(``auto.offset.reset`` is ``error``), and every ``updates.log_check_interval_s`` (:class:`LogWatch`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from confluent_kafka import KafkaException, TopicCollection
from prometheus_client import Counter

from hps_service.runtime.background import BackgroundThread
from hps_service.tiers.base import Tier
from hps_service.updates.stall import BrokerOffsets

log = logging.getLogger(__name__)

Partition = tuple[str, int]

LOG_GAPS = Counter(
    "hps_update_log_gaps",
    "Partitions found to have lost updates: the position their rows were applied up to is below the log's start, "
    "or the topic was deleted and created again; the replica is not ready until they are bootstrapped again",
    ["topic", "partition"],
)

BELOW_START, RECREATED = "below_start", "recreated"
_ID_PREFIX, _LOST_PREFIX = "log-id:", "log-lost:"


def topic_id_key(topic: str) -> str:
    """The metadata key of the topic id the stored positions of ``topic`` refer to (it travels with snapshots)."""
    return _ID_PREFIX + topic


@dataclass(frozen=True)
class LostLog:
    """One partition that lost updates: where its rows stand, where its log starts now, and why."""

    topic: str
    partition: int
    position: int  # the next offset the rows were applied up to
    log_start: int  # the partition's first offset now
    reason: str  # BELOW_START | RECREATED
    topic_id: str | None = None  # the topic's id now (RECREATED: the new one)
    at: float = field(default_factory=time.time)

    @property
    def part(self) -> Partition:
        return (self.topic, self.partition)

    def describe(self) -> str:
        """What was lost, for the log, /readyz and /v1/stats."""
        where = f"{self.topic}[{self.partition}]"
        if self.reason == RECREATED:
            return (f"{where}: the topic was deleted and created again; the updates after offset {self.position} "
                    f"of the log its rows were applied from are lost")
        return (f"{where}: offsets {self.position}..{self.log_start - 1} are no longer in the log (it starts at "
                f"{self.log_start})")


def check_start(part: Partition, stored: int, log_start: int, recreated: bool, topic_id: str | None = None
                ) -> LostLog | None:
    """Whether a partition whose rows stand at ``stored`` (negative: the store holds no position for it, and it
    starts at the log's start) lost updates, given the log's start now and whether its topic was created again
    since the rows were applied from it."""
    if stored < 0:
        return None
    if recreated and stored > 0:
        return LostLog(part[0], part[1], stored, log_start, RECREATED, topic_id)
    if stored < log_start:
        return LostLog(part[0], part[1], stored, log_start, BELOW_START, topic_id)
    return None


class LogLedger:
    """Which topic (id) each topic's stored positions were applied from, and the partitions that lost updates:
    in the persistent tier's metadata, so that a restart still knows (in memory where there is none)."""

    def __init__(self, tier: Tier | None) -> None:
        self._tier = tier
        self._memory: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _get(self, prefix: str) -> dict[str, bytes]:
        if self._tier is not None and self._tier.stores_positions:
            return self._tier.metadata(prefix)
        return {k: v for k, v in self._memory.items() if k.startswith(prefix)}

    def _set(self, key: str, value: bytes | None) -> None:
        if self._tier is not None and self._tier.stores_positions and self._tier.set_metadata(key, value):
            return
        if value is None:
            self._memory.pop(key, None)
        else:
            self._memory[key] = value

    def topic_id(self, topic: str) -> str | None:
        value = self._get(topic_id_key(topic)).get(topic_id_key(topic))
        return value.decode() if value is not None else None

    def set_topic_id(self, topic: str, topic_id: str) -> None:
        if self.topic_id(topic) != topic_id:
            self._set(topic_id_key(topic), topic_id.encode())

    def lost(self, topics: Collection[str] | None = None) -> dict[Partition, LostLog]:
        """The partitions recorded as having lost updates (of ``topics``, or all)."""
        with self._lock:
            return {p: x for p, x in self._read().items() if topics is None or p[0] in topics}

    def mark_lost(self, lost: Iterable[LostLog]) -> None:
        self._update(lambda current: {**current, **{x.part: x for x in lost}})

    def recovered(self, parts: Collection[Partition]) -> None:
        self._update(lambda current: {p: x for p, x in current.items() if p not in parts})

    def _read(self) -> dict[Partition, LostLog]:
        out: dict[Partition, LostLog] = {}
        for value in self._get(_LOST_PREFIX).values():
            out.update({(e["topic"], e["partition"]): LostLog(**e) for e in json.loads(value)})
        return out

    def _update(self, change: Callable[[dict[Partition, LostLog]], dict[Partition, LostLog]]) -> None:
        with self._lock:
            current = self._read()
            updated = change(current)
            for topic in {p[0] for p in current} | {p[0] for p in updated}:
                entries = [asdict(x) for p, x in sorted(updated.items()) if p[0] == topic]
                self._set(_LOST_PREFIX + topic, json.dumps(entries).encode() if entries else None)


class BrokerLogs(BrokerOffsets):
    """What the broker says of the logs now: each partition's start and listed end, each topic's id."""

    def __init__(self, client_config: dict[str, Any], timeout_s: float = 10.0) -> None:
        super().__init__(client_config, timeout_s)

    def topic_ids(self, topics: Collection[str]) -> dict[str, str]:
        """The id of each of ``topics`` the broker described (brokers without topic ids leave them out)."""
        if not topics:
            return {}
        try:
            futures = self._admin.describe_topics(TopicCollection(sorted(topics)), request_timeout=self.timeout_s)
        except KafkaException:
            return {}
        out = {}
        for topic, future in futures.items():
            try:
                topic_id = future.result(timeout=self.timeout_s + 1).topic_id
            except (KafkaException, TimeoutError):
                continue
            if topic_id is not None and str(topic_id) not in ("", "AAAAAAAAAAAAAAAAAAAAAA"):
                out[topic] = str(topic_id)
        return out

    def starts(self, parts: list[Partition]) -> dict[Partition, int]:
        return self.query(parts, latest=False)

    def ends(self, parts: list[Partition]) -> dict[Partition, int]:
        return self.query(parts, latest=True)


def find_losses(broker: BrokerLogs, ledger: LogLedger, positions: Callable[[], dict[Partition, int]],
                topics: Collection[str]) -> list[LostLog]:
    """The partitions of ``topics`` read now (``positions``: next offset of each) that lost updates since: below
    the log's start, or their topic created again. Positions are read after the broker answered, so that a
    consumer moving on meanwhile is never taken for one left behind."""
    ids = broker.topic_ids(topics)
    starts = broker.starts([p for p in positions() if p[0] in topics])
    now = positions()
    out = []
    for part, position in now.items():
        if part[0] not in topics:
            continue
        known = ledger.topic_id(part[0])
        recreated = known is not None and part[0] in ids and ids[part[0]] != known
        if part not in starts and not recreated:
            continue
        lost = check_start(part, position, starts.get(part, 0), recreated, ids.get(part[0]))
        if lost is not None:
            out.append(lost)
    return out


class LogWatch:
    """Every ``interval_s``, in its own thread, looks for the partitions a consumer reads that lost updates
    (:func:`find_losses`); the consumer thread takes what it found with :meth:`take`."""

    def __init__(self, broker: BrokerLogs, ledger: LogLedger, positions: Callable[[], dict[Partition, int]],
                 interval_s: float, name: str = "") -> None:
        self.broker, self.ledger, self.positions = broker, ledger, positions
        self.interval_s = interval_s
        self.name = name
        self._found: list[LostLog] = []
        self._lock = threading.Lock()
        self._worker = BackgroundThread(f"hps-log-watch-{name}", self._run)

    def start(self) -> None:
        self._worker.start()

    def stop(self) -> None:
        self._worker.stop(self.broker.timeout_s + 2)

    def take(self) -> list[LostLog]:
        with self._lock:
            found, self._found = self._found, []
        return found

    def _run(self) -> None:
        while not self._worker.stopping.wait(self.interval_s):
            try:
                topics = {p[0] for p in self.positions()}
                found = find_losses(self.broker, self.ledger, self.positions, topics)
            except Exception:  # the next round asks again; the consumer's own checks go on meanwhile
                log.debug("log watch %s: check failed", self.name, exc_info=True)
                continue
            if found:
                with self._lock:
                    self._found.extend(found)
