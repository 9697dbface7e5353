"""Offset gaps: a partition's next message arrived past the offset the consumer expected.

The offsets of a partition written by idempotent, non-transactional producers (ours) are contiguous, so a gap is
either a record this fetch could not see yet, or a legitimate hole (a transaction marker, a compacted topic). The
first happens: tansu's memory storage acknowledges a record to its producer before every fetch can see it when
several producers write one partition at once, and a consumer that moved past it would have skipped an acknowledged
update for good. So the consumer reads a gap again until it closes, and moves past it only once it stayed the same
for ``recheck_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

Partition = tuple[str, int]


class OffsetGaps:
    """The next offset expected per partition, and the gaps being read again (see the module docstring)."""

    def __init__(self, recheck_s: float) -> None:
        """``recheck_s``: how long a gap must stay unchanged before it is accepted as a hole; 0 turns checking off."""
        self.recheck_s = recheck_s
        self._expected: dict[Partition, int] = {}
        self._open: dict[Partition, tuple[int, int, float]] = {}  # partition -> (expected, got, first seen)
        #: Gaps read again (each once), gaps a second read closed (the missing record arrived), gaps accepted.
        self.seen = 0
        self.closed = 0
        self.accepted = 0

    def expect(self, part: Partition, offset: int) -> None:
        """The partition reads from ``offset`` now (assigned, resumed); negative: unknown, nothing is checked."""
        self._open.pop(part, None)
        if offset >= 0:
            self._expected[part] = offset
        else:
            self._expected.pop(part, None)

    def forget(self, parts: Iterable[Partition]) -> None:
        """The partitions are no longer read."""
        for part in parts:
            self._expected.pop(part, None)
            self._open.pop(part, None)

    def check(self, part: Partition, offset: int) -> int | None:
        """None when the message at ``offset`` may be taken; else the offset to read the partition again from."""
        expected = self._expected.get(part)
        if expected is None or offset <= expected or self.recheck_s <= 0:
            return None
        now = time.monotonic()
        gap = self._open.get(part)
        if gap is None or gap[:2] != (expected, offset):
            self._open[part] = (expected, offset, now)
            self.seen += 1
            return expected
        if now - gap[2] < self.recheck_s:
            return expected
        del self._open[part]
        self.accepted += 1
        log.info("update partition %s[%d]: offsets %d..%d are a hole (no record after %.2f s); moving on",
                 part[0], part[1], expected, offset - 1, now - gap[2])
        return None

    def taken(self, part: Partition, offset: int) -> None:
        """The message at ``offset`` was taken: the partition expects the next one."""
        gap = self._open.pop(part, None)
        if gap is not None and offset < gap[1]:
            self.closed += 1
            log.warning("update partition %s[%d]: offset %d was delivered only when read again (the broker "
                        "acknowledged it before a fetch could see it)", part[0], part[1], offset)
        self._expected[part] = offset + 1

    def stats(self) -> dict[str, int]:
        """Counts for /v1/stats."""
        return {"offset_gaps_seen": self.seen, "offset_gaps_closed": self.closed,
                "offset_gaps_accepted": self.accepted}
