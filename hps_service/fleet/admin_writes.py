"""Admin row writes in a fleet: with Kafka updates on, REST puts, deletes and tombstone purges are published to the
model's update topic, so every replica applies them, and answered once the broker acknowledged them (optionally
once this replica applied them too)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hps_service.config import DEFAULT_PARTITIONS, UpdatesConfig
from hps_service.config.base import split_served
from hps_service.engine.api import Engine
from hps_service.errors import FailedPreconditionError, UnavailableError
from hps_service.updates import Publisher
from hps_service.updates.consumer import UpdateConsumer
from hps_service.updates.publisher import Deliveries, connection_settings


class LogWriter:
    """Publishes admin writes to the update topics; one idempotent producer per model, created on first use."""

    def __init__(
        self, cfg: UpdatesConfig, engine: Engine, consumer: UpdateConsumer | None, ack_timeout_s: float = 30.0,
        partitions: int = DEFAULT_PARTITIONS,
    ) -> None:
        """``partitions``: what a missing topic is created with (``cluster.partitions``, which shards rely on)."""
        self.cfg = cfg
        self.partitions = partitions
        self.engine = engine
        self.consumer = consumer
        self.ack_timeout_s = ack_timeout_s
        self._publishers: dict[str, Publisher] = {}
        self._lock = threading.Lock()

    def _publisher(self, model: str) -> Publisher:
        """The producer of ``model``, a served name: a version's writes go to its model's topic, marked with it."""
        with self._lock:
            pub = self._publishers.get(model)
            if pub is None:
                key = self.cfg.admin_key.get_secret_value() if self.cfg.admin_key is not None else None
                name, version = split_served(model)
                pub = Publisher(self.cfg.brokers, name, topic_prefix=self.cfg.topic_prefix, partitions=self.partitions,
                                replication_factor=self.cfg.replication_factor,
                                min_insync_replicas=self.cfg.min_insync_replicas, admin_key=key,
                                model_version=version, **{**connection_settings(self.cfg.kafka_config), "linger.ms": 0})
                self._publishers[model] = pub
            return pub

    def prepare(self, models: list[str]) -> None:
        """Create the producers of ``models`` ahead of the first write (topic metadata and the idempotent producer's
        id take about a second to get), in the background; a failure here only defers it to the first write."""
        def connect() -> None:
            for model in models:
                try:
                    self._publisher(model)
                except UnavailableError:
                    return

        threading.Thread(target=connect, name="hps-log-writer", daemon=True).start()

    def put(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, version: int,
            wait_applied: bool) -> dict[str, Any]:
        """Publish rows at ``version``; returns what was published (and whether this replica applied it)."""
        self.engine.table(model, table)
        pub = self._publisher(model)
        deliveries = Deliveries()
        pub.publish(table, keys, vectors, version, deliveries=deliveries)
        return self._answer(model, pub, deliveries, int(keys.shape[0]), wait_applied)

    def delete(self, model: str, table: str, keys: np.ndarray, version: int | None,
               wait_applied: bool) -> dict[str, Any]:
        """Publish tombstones; without ``version`` each key's is the version this replica holds for it once it applied
        every write acknowledged before (0 when it holds none): the delete removes the row as it is now, and a newer
        write still wins."""
        t = self.engine.table(model, table)
        keys = np.unique(np.asarray(keys, dtype=np.int64))
        if version is None:
            # read-your-writes: every write acknowledged before this delete is applied here before versions are read
            if self.consumer is None:
                raise UnavailableError("this replica consumes no update topic; give the delete a version")
            if not self.consumer.wait_applied_to_end(split_served(model)[0], self.ack_timeout_s):
                raise UnavailableError(f"this replica did not catch up with the update topic within "
                                       f"{self.ack_timeout_s:g} s; give the delete a version")
            versions = np.zeros(keys.shape[0], dtype=np.int64)
            for tier in (self.engine.volatile, self.engine.persistent):
                if tier is not None and keys.shape[0]:
                    rows = tier.get(t.id, keys)
                    versions = np.maximum(versions, np.where(rows.found, rows.versions, 0))
        else:
            versions = np.full(keys.shape[0], version, dtype=np.int64)
        pub = self._publisher(model)
        deliveries = Deliveries()
        pub.delete(table, keys, versions, deliveries=deliveries)
        return self._answer(model, pub, deliveries, int(keys.shape[0]), wait_applied)

    def check_admin_messages(self) -> None:
        """FailedPreconditionError unless admin-only messages can be published: replicas refuse them unsigned."""
        if self.cfg.admin_key is None:
            raise FailedPreconditionError("a tombstone purge goes through the update topic, and replicas apply it only "
                                          "signed: set updates.admin_key (the same on every replica)")

    def purge_tombstones(self, model: str, table: str, below_version: int, wait_applied: bool) -> dict[str, Any]:
        """Publish a purge of ``table``'s tombstones older than ``below_version`` to every partition, signed."""
        self.check_admin_messages()
        self.engine.table(model, table)
        pub = self._publisher(model)
        deliveries = Deliveries()
        pub.purge_tombstones(table, below_version, deliveries=deliveries)
        return self._answer(model, pub, deliveries, 0, wait_applied)

    def _answer(self, model: str, pub: Publisher, deliveries: Deliveries, rows: int,
                wait_applied: bool) -> dict[str, Any]:
        offsets = pub.wait(deliveries, self.ack_timeout_s)
        out: dict[str, Any] = {"published": rows, "topic": pub.topic,
                               "offsets": {str(p): o for p, o in sorted(offsets.items())}}
        if wait_applied:
            if self.consumer is None:
                raise UnavailableError("this replica consumes no update topic; it cannot wait for the apply")
            positions = {(pub.topic, p): o for p, o in offsets.items()}
            if not self.consumer.wait_applied(positions, self.ack_timeout_s):
                raise UnavailableError(f"published and acknowledged, but not applied by this replica within "
                                       f"{self.ack_timeout_s:g} s")
            out["applied"] = True
        return out

    def close(self) -> None:
        """Flush and drop the producers."""
        with self._lock:
            publishers, self._publishers = self._publishers, {}
        for pub in publishers.values():
            try:
                pub.flush(5)
            except UnavailableError:
                pass
