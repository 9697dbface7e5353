"""Where an update consumer stands on each partition: the next offset applied to the engine and where the partition
was assigned, and the waits on them (read-your-writes). The catch-up targets and lag are :mod:`catch_up`'s; this
holds the positions they are measured against, under the same condition.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from confluent_kafka import TopicPartition

from hps_service.updates.catch_up import CatchUp

Partition = tuple[str, int]


class Progress:
    """Applied and starting offsets per partition (see the module docstring)."""

    def __init__(self, catch_up: CatchUp) -> None:
        self.catch_up = catch_up
        #: Guards ``applied`` and is notified as it moves (the catch-up's condition).
        self.cond = catch_up.cond
        #: The next offset to read, per partition, applied to the engine.
        self.applied: dict[Partition, int] = {}
        #: Where each partition was last assigned.
        self.start_offsets: dict[Partition, int] = {}

    def positions(self, assigned: Iterable[TopicPartition]) -> dict[Partition, int]:
        """The next offset of each partition of ``assigned`` (applied, or where it was assigned)."""
        return {(tp.topic, tp.partition): self.applied.get((tp.topic, tp.partition),
                                                           self.start_offsets.get((tp.topic, tp.partition), 0))
                for tp in list(assigned)}

    def advance(self, offsets: Mapping[Partition, int], fetched: Mapping[Partition, int]) -> None:
        """A batch brought the partitions to ``offsets`` (next offsets, applied); its fetch responses showed the
        high watermarks ``fetched``."""
        with self.cond:
            self.applied.update(offsets)
            self.catch_up.advance(offsets, fetched)

    def wait_applied(self, positions: dict[Partition, int], timeout: float) -> bool:
        """Block until every ``(topic, partition) -> offset`` in ``positions`` is applied (the message at that
        offset included), or the timeout; returns whether it was."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(max(self.applied.get(k, -1), self.start_offsets.get(k, -1)) > o
                          for k, o in positions.items()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(min(remaining, 0.1))
        return True
