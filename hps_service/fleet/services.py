"""What a replica runs beside its update consumer in a fleet (``updates.type: kafka``): the registration log that
carries runtime registrations to every replica (:mod:`registry_log`), and the bootstrap of partitions that lost
updates (:mod:`recovery`, with a snapshot store). The server (``server.app``) starts them and asks them whether
the replica is ready."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hps_service.config import HPSConfig
from hps_service.engine.api import Engine
from hps_service.fleet.recovery import LostUpdatesRecovery
from hps_service.fleet.registry_log import ModelRegistrations, RegistryChange, RegistryLog
from hps_service.fleet.snapshots import BucketSnapshots
from hps_service.fleet.switch_gate import SwitchGate
from hps_service.updates.consumer import UpdateConsumer

log = logging.getLogger(__name__)

class FleetServices:
    """The registration log and the recovery of lost partitions of one replica (see the module docstring)."""

    def __init__(self, config: HPSConfig, engine: Engine, models_changed: Callable[[], None],
                 group: str, not_ready: Callable[[], list[str]] = list) -> None:
        """``not_ready``: why this replica is not ready (what its status tells the others' switch gates)."""
        self.config = config
        self.registry: RegistryLog | None = None
        self.recovery: LostUpdatesRecovery | None = None
        self.registrations = ModelRegistrations(engine, {m.name for m in config.models}, models_changed,
                                                lambda: self.registry)
        self.gate: SwitchGate | None = None
        if config.updates.type == "kafka":
            self.registry = RegistryLog(config.updates, engine.persistent, self.registrations.apply, group)
            if self.registry.signs:
                registry = self.registry

                def publish(status: dict[str, Any]) -> None:
                    registry.publish(RegistryChange.of_status(status))

                self.gate = SwitchGate(group, engine, not_ready, publish)
                self.registrations.gate = self.gate

    def start(self) -> None:
        if self.registry is not None:
            self.registry.start()
        if self.gate is not None:
            self.gate.start()

    def watch_losses(self, consumer: UpdateConsumer, snapshots: BucketSnapshots | None) -> None:
        """Bootstrap ``consumer``'s lost partitions again from the snapshot store, if there is one (looked at every
        ``updates.log_check_interval_s`` while partitions are lost)."""
        if snapshots is None or self.recovery is not None:
            return
        self.recovery = LostUpdatesRecovery(consumer, snapshots.store.bucket, snapshots.restore,
                                            self.config.updates.log_check_interval_s)
        self.recovery.start()

    def not_ready(self) -> str | None:
        """Why the replica is not ready on the fleet's side (registrations on the log not applied yet), or None."""
        return self.registry.not_ready() if self.registry is not None else None

    def stats(self) -> dict[str, Any]:
        """The ``registry`` section of /v1/stats."""
        out: dict[str, Any] = self.registry.stats() if self.registry is not None else {}
        if self.gate is not None:
            out["members"] = self.gate.stats()
        if self.recovery is not None:
            out["recovery_error"] = self.recovery.last_error
        return out

    def stop(self, timeout: float = 10.0) -> None:
        if self.gate is not None:
            self.gate.stop(timeout)
        if self.recovery is not None:
            self.recovery.stop(timeout)
        if self.registry is not None:
            self.registry.stop(timeout)
