"""Catching up with the update log: which partitions must still be applied up to a log end before the consumer
counts as caught up, how old its oldest unapplied update is, and where each log ends.

Where a log ends is taken from what the consumer has read, so that it is right on any broker. The broker's
ListOffsets answer is only a lower bound: tansu answers the base offset of a partition's last record batch + 1, a
batch short of its end. The high watermark of the consumer's own fetch responses is exact as of that fetch (a
fetch that returns a record returns its whole batch, and a watermark never below it). So a partition reaches its
target only once a fetch response has confirmed it: a target taken from ListOffsets is extended, once, to the high
watermark the fetch responses showed by the time it was reached (new updates arriving later do not move it again).

Lag: the age of a partition's oldest unapplied update is dated from the first time this consumer saw the
partition's end offset pass it (a lower bound, to the refresh interval). A model whose oldest unapplied update is
older than ``max_lag_s`` has to catch up again, to the end offsets seen at that moment.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Collection, Mapping

Partition = tuple[str, int]


class CatchUp:
    """Targets, confirmed ends and lag of one consumer's partitions (see the module docstring).

    The consumer thread changes it under ``cond``; readers (readiness, REST waits) wait on ``cond``.
    """

    def __init__(self, max_lag_s: float) -> None:
        self.max_lag_s = max_lag_s
        self.cond = threading.Condition()
        #: Per partition: the end offset to apply up to before it counts as caught up (absent once it is).
        self.targets: dict[Partition, int] = {}
        self._confirmed: set[Partition] = set()  # targets a fetch response has confirmed (not extended again)
        #: Per partition: the high watermark of the latest fetch response the consumer thread looked at.
        self.fetched_high: dict[Partition, int] = {}
        self._seen_ends: dict[Partition, deque[tuple[int, float]]] = {}
        #: Per partition: age in seconds of its oldest unapplied update, as of the last refresh.
        self.unapplied_age: dict[Partition, float] = {}
        #: The age that sent the consumer back to catching up (for readiness), None while it did not.
        self.lagged_s: float | None = None

    def assigned(self, part: Partition, begin: int, listed_end: int) -> None:
        """``part`` is read from ``begin`` now and the broker listed ``listed_end`` as its end: it catches up once
        applied up to that end, as a fetch response confirms it (even where nothing is left to read)."""
        with self.cond:
            self.targets[part] = max(begin, listed_end)
            self._confirmed.discard(part)
            self._seen_ends[part] = deque([(listed_end, time.monotonic())])

    def forget(self, parts: Collection[Partition]) -> None:
        """Partitions no longer read (dropped, parked or lost) no longer count for catching up or lag."""
        with self.cond:
            for part in parts:
                self.targets.pop(part, None)
                self._confirmed.discard(part)
                self._seen_ends.pop(part, None)
                self.unapplied_age.pop(part, None)
                self.fetched_high.pop(part, None)

    def advance(self, positions: Mapping[Partition, int], fetched: Mapping[Partition, int]) -> None:
        """The consumer stands at ``positions`` (next offsets, applied) and its fetch responses showed the high
        watermarks ``fetched``: partitions that reached a confirmed target leave ``targets``. Call under ``cond``."""
        for part, high in fetched.items():
            if high >= 0:
                self.fetched_high[part] = high
        for part, position in positions.items():
            end = self.targets.get(part)
            if end is None or position < end:
                continue
            high = self.fetched_high.get(part, -1)
            if high < 0:
                continue  # no fetch response yet: the end is not confirmed
            if part not in self._confirmed and high > end:
                self.targets[part] = high
                self._confirmed.add(part)
                if position < high:
                    continue
            del self.targets[part]
            self._confirmed.discard(part)
        if not self.targets:
            self.lagged_s = None
        self.cond.notify_all()

    def end(self, part: Partition, listed_end: int) -> int:
        """Where ``part`` ends as far as this consumer knows: the broker's listed end or the fetch responses'."""
        return max(listed_end, self.fetched_high.get(part, -1))

    def reason(self, parts: Collection[Partition], positions: Mapping[Partition, int]) -> str | None:
        """Why ``parts`` are not caught up, or None when they are."""
        targets = {p: end for p, end in self.targets.items() if p in parts}
        if not targets:
            return None
        behind = sum(max(0, end - positions.get(p, 0)) for p, end in targets.items())
        if self.lagged_s is not None:
            return (f"fell behind: an unapplied update was {self.lagged_s:.0f} s old (updates.max_lag_s="
                    f"{self.max_lag_s:g}); catching up, {len(targets)} partition(s), {behind} messages to go")
        return (f"catching up: {len(targets)} partition(s) not yet applied up to the end offsets seen at "
                f"assignment ({behind} messages to go)")

    def refresh(self, highs: Mapping[Partition, int], positions: Mapping[Partition, int],
                models: Mapping[str, str]) -> dict[str, tuple[float, int]]:
        """Date the oldest unapplied update of each partition from the high watermarks ``highs`` (fetch responses)
        and the ``positions`` applied; models (``models``: topic -> model) whose oldest is older than
        ``max_lag_s`` must catch up again to ``highs``. Returns those models with (oldest age, partitions behind)."""
        now = time.monotonic()
        ages: dict[Partition, float] = {}
        with self.cond:
            for part, high in highs.items():
                done = positions.get(part, 0)
                seen = self._seen_ends.setdefault(part, deque())
                if not seen or high > seen[-1][0]:
                    seen.append((high, now))
                while seen and seen[0][0] <= done:
                    seen.popleft()
                ages[part] = now - seen[0][1] if seen and high > done else 0.0
            self.unapplied_age = ages
            self.advance(positions, highs)
            if self.max_lag_s <= 0:
                return {}
            late = {models.get(p[0]) for p, age in ages.items() if age > self.max_lag_s and p not in self.targets}
            out: dict[str, tuple[float, int]] = {}
            for model in late:
                if model is None:
                    continue
                behind = {p: high for p, high in highs.items() if models.get(p[0]) == model and
                          high > positions.get(p, 0)}
                out[model] = (max((ages[p] for p in behind), default=0.0), len(behind))
                self.targets.update(behind)
                self._confirmed.update(behind)  # the fetch responses' own watermarks: nothing to confirm
                self.lagged_s = out[model][0]
            return out
