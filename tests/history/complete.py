"""The complete state of the history's table through a run (:mod:`hps_service.tiers.hashmap.complete`): what the
owner's ``/v1/stats`` said, polled all through, so the check can tell that each event that sets or loses the state
happened while the readers read (the preload after a start, imports that fit, the eviction of a wider key reach)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.history.server import HistoryServer


@dataclass
class Sample:
    at: float
    starts: int  # the server's starts so far (a restart resets its counters)
    complete: bool
    lost: int  # losses in this start
    evictions: int
    imports_done: int


@dataclass
class CompleteWatch:
    """Polls ``server``'s table every ``period_s`` until :meth:`stop`; ``imports()`` counts acknowledged imports."""

    server: HistoryServer
    imports: object  # () -> int
    period_s: float = 0.05
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="history-complete-watch", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        url = f"{self.server.http}/v1/stats"
        while not self._stop.wait(self.period_s):
            try:
                table = httpx.get(url, timeout=5).json()["models"][self.server.model]["tables"][self.server.table]
            except (httpx.HTTPError, ValueError, KeyError):
                continue  # the server is restarting
            v = table["volatile"]
            self.samples.append(Sample(time.monotonic(), self.server.starts, bool(v.get("complete")),
                                       int(v.get("complete_lost", 0)), int(v.get("evictions", 0)),
                                       self.imports()))  # type: ignore[operator]

    def summary(self, widened_at: float) -> dict[str, int]:
        """Per start: complete seen, losses; imports acknowledged with the table complete again right after (and no
        eviction since the sample before); losses after the reach widened that came with evictions."""
        out = {"starts complete": 0, "losses": 0, "losses with evictions after widening": 0,
               "imports kept complete": 0}
        for start in sorted({s.starts for s in self.samples}):
            mine = [s for s in self.samples if s.starts == start]
            out["starts complete"] += any(s.complete for s in mine)
            out["losses"] += max(s.lost for s in mine)
            out["losses with evictions after widening"] += any(
                s.at > widened_at and s.lost and s.evictions and not s.complete for s in mine)
            for a, b in zip(mine, mine[1:]):  # an import loses the state while it runs, and regains it if it fit
                out["imports kept complete"] += (b.imports_done > a.imports_done and b.complete
                                                 and a.evictions == b.evictions)
        return out
