"""Whether every replica of the fleet can take a label switch: each replica's status on the registration log, and
the wait a ``PUT /v1/models/{m}/labels/{label}`` makes for it.

Every ``PUBLISH_S`` each replica puts its status on the registration log (signed, keyed ``status:<replica>``, so
compaction keeps the last one): for each model and version it serves, what keeps a label from pointing at it here
(not preloaded yet, the replica not ready: its updates not caught up, ...; empty: switchable). Every replica follows
the log, so each knows the others' statuses. A replica is a member while its statuses keep coming: one not heard of
for ``LEASE_S`` (stopped, or gone) no longer holds a switch back. Before a switch goes on the log, the replica asked
waits up to ``WAIT_S`` until every member reports the version switchable, else the switch is refused with what is
missing, replica by replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hps_service.config.base import served_name
from hps_service.engine.api import Engine
from hps_service.errors import FailedPreconditionError, HPSError
from hps_service.runtime.background import BackgroundThread

log = logging.getLogger(__name__)

#: Seconds between a replica's statuses, how long a member is waited for without one, and how long a PUT waits.
PUBLISH_S, LEASE_S, WAIT_S = 1.0, 10.0, 10.0
#: A status stamped (by its replica's clock) longer ago than this is a dead replica's, read again from the log.
STALE_S = 60.0


@dataclass(frozen=True)
class ReplicaStatus:
    """What one replica said last: when (its wall clock), when it arrived here (this monotonic clock), per served
    name what keeps a switch to it back there (empty: switchable), and per served name the tables that hold no rows
    there (what a switch with ``allow_empty`` passes over)."""

    replica: str
    at: float
    received: float
    served: dict[str, list[str]]
    empty: dict[str, list[str]] = field(default_factory=dict)


def local_status(engine: Engine, not_ready: Callable[[], list[str]]) -> dict[str, Any]:
    """This replica's status: per served name (every model and version, and the versions being imported or failed
    here) what keeps a label from pointing at it, and apart, what only a switch with ``allow_empty`` passes over."""
    reasons = not_ready()
    served: dict[str, list[str]] = {}
    empty: dict[str, list[str]] = {}
    for m in engine.served_models():
        hard = engine.not_switchable(m.name, m.version, allow_empty=True)
        served[m.served_name] = [*hard, *reasons]
        if extra := [r for r in engine.not_switchable(m.name, m.version) if r not in hard]:
            empty[m.served_name] = extra
    for m in engine.models():
        for version in engine.states.unserved(m.name):
            served[served_name(m.name, version)] = engine.not_switchable(m.name, version, allow_empty=True)
    return {"served": served, "empty": empty}


class SwitchGate:
    """The statuses of the fleet's replicas, this one's published, and the wait before a switch."""

    def __init__(self, replica: str, engine: Engine, not_ready: Callable[[], list[str]],
                 publish: Callable[[dict[str, Any]], None]) -> None:
        """``publish(status)``: put this replica's status on the registration log."""
        self.replica = replica
        self.engine = engine
        self.not_ready = not_ready
        self.publish = publish
        self._statuses: dict[str, ReplicaStatus] = {}
        self._worker = BackgroundThread("hps-switch-gate", self._run)

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._worker.stop(timeout)

    def _run(self) -> None:
        while not self._worker.stopping.wait(PUBLISH_S):
            try:
                self.publish({"replica": self.replica, "at": time.time(),
                              **local_status(self.engine, self.not_ready)})
            except HPSError as exc:  # the broker away: the next period tries again; members wait out the lease
                log.debug("switch gate: status not published: %s", exc)

    def record(self, status: dict[str, Any]) -> None:
        """A status read from the log (a dead replica's, read again at start, is dropped by its age)."""
        if time.time() - float(status["at"]) > STALE_S:
            return
        served = {str(k): [str(r) for r in v] for k, v in dict(status["served"]).items()}
        empty = {str(k): [str(r) for r in v] for k, v in dict(status.get("empty") or {}).items()}
        got = ReplicaStatus(str(status["replica"]), float(status["at"]), time.monotonic(), served, empty)
        self._statuses = {**self._statuses, got.replica: got}

    def members(self) -> dict[str, ReplicaStatus]:
        """The other replicas heard of within the lease."""
        now = time.monotonic()
        return {r: s for r, s in self._statuses.items() if r != self.replica and now - s.received <= LEASE_S}

    def missing(self, model: str, version: int, allow_empty: bool = False) -> list[str]:
        """What keeps the other members from taking a switch to ``version`` of ``model`` (empty: nothing); a table
        without rows does unless ``allow_empty``."""
        name = served_name(model, version)
        out = []
        for replica, status in sorted(self.members().items()):
            reasons = [*status.served.get(name, []), *([] if allow_empty else status.empty.get(name, []))]
            if name not in status.served:
                what = f"version {version} of model '{model}'" if version else f"model '{model}'"
                out.append(f"replica {replica} does not serve {what} yet")
            elif reasons:
                out.append(f"replica {replica}: {'; '.join(reasons)}")
        return out

    def wait(self, model: str, version: int, timeout: float | None = None, allow_empty: bool = False) -> None:
        """Return once every member reports ``version`` switchable (``allow_empty``: tables without rows
        included); FailedPreconditionError naming what is missing after ``timeout`` seconds (default ``WAIT_S``)."""
        deadline = time.monotonic() + (WAIT_S if timeout is None else timeout)
        while missing := self.missing(model, version, allow_empty):
            if time.monotonic() >= deadline:
                raise FailedPreconditionError(f"version {version} of model '{model}' is not switchable on every "
                                              f"replica yet: {' | '.join(missing)}")
            time.sleep(0.05)

    def stats(self) -> dict[str, Any]:
        """The ``registry.members`` section of /v1/stats: each member and how long ago it was heard of."""
        now = time.monotonic()
        return {r: {"heard_s_ago": round(now - s.received, 1)} for r, s in sorted(self.members().items())}
