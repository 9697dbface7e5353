"""A stalled update stream made loud: messages wait on the topic and none is applied for ``updates.stall_after_s``.

The detector runs in its own thread beside the consumer and reads the consumer's bookkeeping (the next offset
applied per partition, the assignment, when messages last arrived). The end offsets it compares them with come
from the broker on the detector's own AdminClient connection (ListOffsets): the end offsets that the consumer's
fetch responses carry stop moving exactly when its fetches stall, so they cannot tell a stall from a quiet topic.
Because it does not run in the consumer thread, a consumer thread that hangs is caught too.

A stall shows as a WARNING log (the messages waiting, for how long nothing was applied, when a message last
arrived), repeated every ``stall_after_s`` while it lasts; as ``hps_update_stalled{topic}`` = 1 and
``hps_update_since_last_applied_seconds{topic,partition}``; and as the reason /readyz answers 503.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from prometheus_client import Gauge

from hps_service.updates.metrics import SINCE_LAST_APPLIED, UPDATE_STALLED

log = logging.getLogger(__name__)

#: (topic, partition)
Partition = tuple[str, int]


def _name(part: Partition) -> str:
    return f"{part[0]}[{part[1]}]"


class BrokerOffsets:
    """End (or start) offsets of partitions asked from the broker with one ListOffsets request per call."""

    def __init__(self, client_config: dict[str, Any], timeout_s: float) -> None:
        self._admin = AdminClient(client_config)
        self.timeout_s = timeout_s

    def query(self, partitions: list[Partition], latest: bool = True) -> dict[Partition, int]:
        """Offsets of ``partitions`` the broker answered within the timeout (the others are left out)."""
        if not partitions:
            return {}
        spec = OffsetSpec.latest() if latest else OffsetSpec.earliest()
        try:
            futures = self._admin.list_offsets({TopicPartition(t, p): spec for t, p in partitions},
                                               request_timeout=self.timeout_s)
        except KafkaException:
            return {}
        out: dict[Partition, int] = {}
        deadline = time.monotonic() + self.timeout_s + 1.0
        for tp, future in futures.items():
            try:
                out[(tp.topic, tp.partition)] = int(future.result(timeout=max(0.0, deadline - time.monotonic())).offset)
            except (KafkaException, TimeoutError):
                continue
        return out


@dataclass
class _Progress:
    """What the detector knows of one partition."""

    since: float  # monotonic time the applied offset last advanced, or the partition was last caught up
    applied: int | None = None  # next offset to apply
    base: int | None = None  # where applying starts while nothing is applied yet (committed or earliest offset)
    end: int | None = None  # the broker's end offset, as last asked

    def waiting(self) -> int:
        """Messages published and not applied yet (0 while unknown)."""
        done = self.applied if self.applied is not None else self.base
        if self.end is None or done is None:
            return 0
        return max(0, self.end - done)


class StallDetector:
    """Watches one consumer's partitions for a stall; see the module docstring.

    ``applied`` returns the next offset applied per partition, ``starts`` the offset each partition was assigned
    at (negative for "the earliest"), ``assigned`` the partitions consumed now. ``received()`` is called by the
    consumer when messages arrive.
    """

    def __init__(
        self,
        stall_after_s: float,
        *,
        client_config: dict[str, Any],
        applied: Callable[[], dict[Partition, int]],
        starts: Callable[[], dict[Partition, int]],
        assigned: Callable[[], list[Partition]],
        name: str = "",
        interval_s: float | None = None,
    ) -> None:
        self.stall_after_s = stall_after_s
        self.interval_s = interval_s if interval_s is not None else min(5.0, max(0.2, stall_after_s / 6))
        self.name = name
        self._client_config = client_config
        self._applied, self._starts, self._assigned = applied, starts, assigned
        self._parts: dict[Partition, _Progress] = {}
        self._offsets: BrokerOffsets | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_message_at: float | None = None  # monotonic
        self._last_message_wall: float | None = None
        self._stalled: list[Partition] = []
        self._stalled_since: float | None = None
        self._last_warning = 0.0
        self._reason: str | None = None
        self._series: set[Partition] = set()
        self._series_topics: set[str] = set()

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching in a daemon thread (idle while nothing is assigned)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"hps-stall-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and remove this consumer's series; waits at most ``timeout_s`` (a broker that does not
        answer must not eat the shutdown's grace period: the thread is a daemon and ends after its request)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._set_gauges({}, set())

    def received(self) -> None:
        """The consumer got messages from the broker just now."""
        self._last_message_at = time.monotonic()
        self._last_message_wall = time.time()

    # ---- what others read -------------------------------------------------------------------------------
    @property
    def reason(self) -> str | None:
        """Why the stream counts as stalled (for /readyz), or None."""
        return self._reason

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view for /v1/stats."""
        now = time.monotonic()
        with self._lock:
            parts = {
                _name(part): {"waiting": p.waiting(), "applied": p.applied, "end": p.end,
                              "seconds_since_applied": round(now - p.since, 3) if p.waiting() else 0.0}
                for part, p in sorted(self._parts.items())
            }
            return {
                "stalled": bool(self._stalled),
                "stall_after_s": self.stall_after_s,
                "stalled_partitions": [_name(p) for p in self._stalled],
                "last_message_age_s": None if self._last_message_at is None else round(now - self._last_message_at, 3),
                "partitions": parts,
            }

    # ---- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001  (the watcher must outlive a broker hiccup)
                log.exception("stall detector %s: check failed", self.name)

    def check(self) -> None:
        """One round: ask the end offsets, compare with what was applied, update the log, metrics and reason."""
        assigned = sorted(set(self._assigned()))
        if not assigned:
            return
        if self._offsets is None:
            self._offsets = BrokerOffsets(self._client_config, timeout_s=max(1.0, min(10.0, self.interval_s * 4)))
        ends = self._offsets.query(assigned)
        applied = self._applied()
        starts = self._starts()
        now = time.monotonic()
        with self._lock:
            for part in [p for p in self._parts if p not in assigned]:
                del self._parts[part]
            unknown_base = []
            for part in assigned:
                prog = self._parts.setdefault(part, _Progress(since=now))
                offset = applied.get(part)
                if offset is not None and (prog.applied is None or offset > prog.applied):
                    prog.applied, prog.since = offset, now
                if prog.applied is None and prog.base is None:
                    start = starts.get(part, -1)
                    if start >= 0:
                        prog.base = start
                    else:
                        unknown_base.append(part)
                if part in ends:
                    prog.end = ends[part]
        if unknown_base:  # a new group starting at the earliest offset: that is where applying starts
            earliest = self._offsets.query(unknown_base, latest=False)
            with self._lock:
                for part, offset in earliest.items():
                    if part in self._parts:
                        self._parts[part].base = offset
        self._judge(now)

    def _judge(self, now: float) -> None:
        with self._lock:
            for prog in self._parts.values():
                if not prog.waiting():
                    prog.since = now  # caught up: the clock starts again
            stalled = [part for part, p in sorted(self._parts.items()) if now - p.since >= self.stall_after_s]
            waiting = {part: p.waiting() for part, p in self._parts.items()}
            ages = {part: (now - p.since) if waiting[part] else 0.0 for part, p in self._parts.items()}
            was = bool(self._stalled)
            self._stalled = stalled
        self._set_gauges(ages, {t for t, _ in stalled})
        if not stalled:
            self._reason = None
            if was:
                log.info("update stream resumed: %s applies again after %.0f s stalled", self.name,
                         now - (self._stalled_since or now))
                self._stalled_since = None
            return
        idle = max(ages[p] for p in stalled)
        summary = f"nothing applied for {idle:.0f} s while {sum(waiting[p] for p in stalled)} messages wait"
        fetched = self._last_message_text(now)
        names = ", ".join(_name(p) for p in stalled[:8]) + (f" and {len(stalled) - 8} more" if len(stalled) > 8 else "")
        self._reason = f"update stream stalled: {summary} on {names}; {fetched}"
        if not was:
            self._stalled_since = now - idle
        if not was or now - self._last_warning >= self.stall_after_s:
            self._last_warning = now
            detail = "; ".join(
                f"{_name(p)}: {waiting[p]} waiting (applied up to {self._parts[p].applied}, end {self._parts[p].end})"
                for p in stalled[:8] if p in self._parts
            )
            log.warning("update stream %s: %s; %s (consumer %s, stall_after_s %g): %s",
                        "still stalled" if was else "stalled", summary, fetched, self.name, self.stall_after_s,
                        detail)

    def _last_message_text(self, now: float) -> str:
        if self._last_message_at is None or self._last_message_wall is None:
            return "no message fetched since the consumer started"
        at = datetime.fromtimestamp(self._last_message_wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"last message fetched {now - self._last_message_at:.0f} s ago ({at})"

    def _set_gauges(self, ages: dict[Partition, float], stalled_topics: set[str]) -> None:
        """Set this consumer's series and remove those of partitions it no longer consumes."""
        topics = {t for t, _ in ages}
        for (topic, partition), age in ages.items():
            SINCE_LAST_APPLIED.labels(topic, str(partition)).set(age)
        for topic in topics:
            UPDATE_STALLED.labels(topic).set(1.0 if topic in stalled_topics else 0.0)
        for topic, partition in self._series - set(ages):
            _remove(SINCE_LAST_APPLIED, topic, str(partition))
        for topic in self._series_topics - topics:
            _remove(UPDATE_STALLED, topic)
        self._series, self._series_topics = set(ages), topics


def _remove(metric: Gauge, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
