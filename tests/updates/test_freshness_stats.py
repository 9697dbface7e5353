"""The consumer's in-process freshness figures stay bounded over a long run, whether or not /v1/stats is read."""

from __future__ import annotations

import time

from hps_service.updates.metrics import FreshnessStats


def test_rate_window_is_pruned_as_batches_are_recorded() -> None:
    stats = FreshnessStats(rate_window_s=0.05)
    for version in range(200):
        stats.record_applied("m", "t", rows=10, received=10, max_version=version)
    time.sleep(0.06)  # every entry so far is now outside the window
    stats.record_applied("m", "t", rows=10, received=10, max_version=200)
    assert len(stats._applied) == 1  # noqa: SLF001  (the bound is the point of the test)
    assert stats.rows_total == 2010 and stats.last_version == {"m.t": 200}
