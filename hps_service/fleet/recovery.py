"""Lost partitions bootstrapped again, in place (see :mod:`hps_service.updates.watermarks` for how a partition is
found to have lost updates).

While partitions are lost, every ``interval_s`` the snapshot store is asked for the newest snapshot of their model
that the log can be replayed from: taken from the same topics (its ``log_ids`` match the topics' ids now) and, for
every lost partition, at a position at or past the log's start now. Its rows of the lost partitions' keys are then
restored through the engine (a key's updates all travel on its partition, so the model's other partitions go on
applying meanwhile), and the consumer resumes those partitions at the snapshot's positions: the replica is ready
again once it has caught up from there. It happens by itself as soon as another replica uploads such a snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps_service.errors import HPSError
from hps_service.fleet.bucket import SnapshotBucket
from hps_service.fleet.positions import positions_from_json
from hps_service.runtime.background import BackgroundThread
from hps_service.updates.consumer import UpdateConsumer
from hps_service.updates.partitioning import partition_of

log = logging.getLogger(__name__)

Partition = tuple[str, int]
#: ``restore(model, snapshot_id, progress, keys)``: rewrite the model's rows of ``keys`` (a key mask) from a snapshot.
Restore = Callable[[str, str, Any, Callable[[np.ndarray], np.ndarray]], Any]


@dataclass
class _Progress:
    """What a restore reports (the fields of a job)."""

    rows_total: int | None = None
    rows_done: int = 0


def key_filter(parts: set[Partition], partition_counts: dict[str, int]) -> Callable[[np.ndarray], np.ndarray]:
    """A mask of the keys that belong to one of ``parts`` (``partition_counts``: partitions of each topic)."""
    wanted = {topic: np.array(sorted(p for t, p in parts if t == topic)) for topic in {t for t, _ in parts}}

    def keep(keys: np.ndarray) -> np.ndarray:
        mask = np.zeros(keys.shape[0], dtype=bool)
        for topic, partitions in wanted.items():
            mask |= np.isin(partition_of(keys, partition_counts[topic]), partitions)
        return mask

    return keep


class LostUpdatesRecovery:
    """Bootstraps a consumer's lost partitions again from ``bucket`` (see the module docstring)."""

    def __init__(self, consumer: UpdateConsumer, bucket: SnapshotBucket, restore: Restore,
                 interval_s: float = 10.0) -> None:
        self.consumer = consumer
        self.bucket = bucket
        self.restore = restore
        self.interval_s = interval_s
        self.last_error: str | None = None
        self._waiting: dict[str, str] = {}  # model -> why no snapshot qualified (logged when it changes)
        self._worker = BackgroundThread("hps-recovery", self._run)

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._worker.stop(timeout)

    def _run(self) -> None:
        while not self._worker.stopping.wait(self.interval_s):
            try:
                self.check_once()
            except HPSError as exc:  # the snapshot store or the broker is away: the next round tries again
                self.last_error = str(exc)
                log.warning("bootstrap of lost partitions failed: %s; trying again in %.0f s", exc, self.interval_s)
            except Exception:
                self.last_error = "bootstrap of lost partitions failed; see the log"
                log.exception("bootstrap of lost partitions failed")

    def check_once(self) -> dict[str, str]:
        """Bootstrap again every model with lost partitions for which a snapshot qualifies; returns
        ``{model: snapshot id}`` of those restored."""
        done: dict[str, str] = {}
        lost = self.consumer.lost()
        for model in sorted({self.consumer.topics[t] for t, _ in lost if t in self.consumer.topics}):
            parts = {p for p in lost if self.consumer.topics.get(p[0]) == model}
            choice = self.usable(model, parts)
            if choice is None:
                continue
            manifest, positions = choice
            log.info("bootstrapping %s again from snapshot %s: the rows of %s, then the log from the snapshot's "
                     "positions", model, manifest["id"], ", ".join(f"{t}[{p}]" for t, p in sorted(parts)))
            keep = key_filter(parts, {t: self.consumer.topic_partitions[t] for t, _ in parts})
            self.restore(model, manifest["id"], _Progress(), keep)
            self.consumer.recover({p: positions.get(p, 0) for p in parts})
            self._waiting.pop(model, None)
            done[model] = manifest["id"]
        return done

    def usable(self, model: str, parts: set[Partition]) -> tuple[dict[str, Any], dict[Partition, int]] | None:
        """The newest snapshot of ``model`` the lost ``parts`` can be replayed from, with its positions."""
        topics = {t for t, _ in parts}
        ids = self.consumer.logs.topic_ids(topics)
        starts = self.consumer.logs.starts(sorted(parts))
        if len(starts) < len(parts):
            return None  # the broker did not answer: ask again next round
        seen = 0
        for manifest in self.bucket.list(model):
            seen += 1
            positions = positions_from_json(manifest.get("positions", []))
            logged = manifest.get("log_ids", {})
            if any(t in ids and logged.get(t) != ids[t] for t in topics):
                continue
            if all(positions.get(p, 0) >= starts[p] for p in parts):
                return manifest, positions
        why = (f"none of the {seen} snapshot(s) of {model} in {self.bucket.url} was taken from these topics at or "
               f"past the logs' start" if seen else f"no snapshot of {model} in {self.bucket.url}")
        if self._waiting.get(model) != why:
            self._waiting[model] = why
            log.warning("lost partitions of %s: %s; waiting for one (looked for every %g s)", model, why,
                        self.interval_s)
        return None
