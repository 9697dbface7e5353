"""The crashes a history run goes through, on a schedule, while the workload runs: the owner SIGKILLed while it
ingests (then restarted on the same volume), and a replica SIGKILLed while it bootstraps from the primary's newest
snapshot (then restarted, bootstrapping again, and read once ready). Counts what it did for the report."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.history.server import HistoryServer
from tests.history.workload import Workload

#: The replica's bandwidth from the snapshot store on its first start (bytes/s): slow enough to be killed mid-way.
BOOTSTRAP_BYTES_PER_S = 8192


@dataclass
class Faults:
    """Kills ``primary`` at each of ``kill_owner_at`` and starts, kills and restarts ``replica`` from ``replica_at``
    (fractions of the run); ``None`` skips it."""

    workload: Workload
    primary: HistoryServer
    replica: HistoryServer | None
    seconds: float
    kill_owner_at: tuple[float, ...] = (0.5,)
    replica_at: float | None = 0.15
    crashes: list[str] = field(default_factory=list)
    laps_before_restarts: int = 0
    errors: list[str] = field(default_factory=list)

    def start(self) -> list[threading.Thread]:
        """One thread per fault (a replica's bootstrap and an owner's restart take seconds each: they overlap)."""
        plans = [(tuple(self.kill_owner_at), self._kill_owner), ((self.replica_at,), self._replica)]
        threads = [threading.Thread(target=self._at, args=(times, what), name=f"history-{what.__name__}", daemon=True)
                   for times, what in plans if times and None not in times]
        for t in threads:
            t.start()
        return threads

    def _at(self, times: tuple[float, ...], what) -> None:  # noqa: ANN001
        started = time.monotonic()
        try:
            for at in sorted(times):
                if self.workload.stopped.wait(max(0.0, started + at * self.seconds - time.monotonic())):
                    return
                what()
        except Exception as exc:  # noqa: BLE001  (reported by the test)
            self.errors.append(f"faults: {type(exc).__name__}: {exc}")

    def _kill_owner(self) -> None:
        """SIGKILL the primary's owner once it is applying updates (rows applied growing), restart it."""
        applied = self._applied(self.primary)
        deadline = time.monotonic() + 30
        while self._applied(self.primary) == applied and time.monotonic() < deadline:
            time.sleep(0.02)
        self.laps_before_restarts += ring_laps(self.primary)
        with self.workload.outage(self.primary.name):
            self.primary.kill()
            self.crashes.append(f"owner SIGKILLed mid-ingest at {time.monotonic() - self.workload.t0:.1f} s")
            self.primary.launch()
            self.primary.wait_ready()

    def _replica(self) -> None:
        """Start the replica on an empty volume, throttled; SIGKILL it while it restores the snapshot; restart it
        and, once ready, read from it."""
        assert self.replica is not None
        with self.workload.outage(self.replica.name):
            self.replica.launch(persistent={"snapshot_upload_bytes_per_s": BOOTSTRAP_BYTES_PER_S})
            deadline = time.monotonic() + 120
            while True:
                _, body = self.replica.readyz()
                progress = body.get("bootstrap") or {}
                if progress.get("state") == "restoring" and progress.get("bytes_done", 0) > 0:
                    break
                assert self.replica.proc is not None and self.replica.proc.poll() is None, "the replica exited"
                assert time.monotonic() < deadline, f"the replica never bootstrapped: {body}"
                time.sleep(0.02)
            self.replica.kill()
            self.crashes.append(f"replica SIGKILLed mid-bootstrap at {time.monotonic() - self.workload.t0:.1f} s "
                                f"({progress.get('bytes_done')} of {progress.get('bytes_total')} bytes restored)")
            self.replica.launch()
            self.replica.wait_ready()
        self.workload.replica = self.replica
        self.workload.replica_readers(self.replica)

    @staticmethod
    def _applied(server: HistoryServer, default: int = -1) -> int:
        try:
            return int(httpx.get(f"{server.http}/v1/stats", timeout=5).json()["updates"].get("rows_applied", 0))
        except (httpx.HTTPError, ValueError, KeyError):
            return default


def ring_laps(server: HistoryServer) -> int:
    """How often the server's change rings lapped since it started (keys noted / slots, every table)."""
    try:
        rings = httpx.get(f"{server.http}/v1/stats", timeout=10).json()["node"]["change_rings"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(r["keys_noted"] // r["slots"] for r in rings.values())
