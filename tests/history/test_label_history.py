"""Label switches in the history checker (issue 30): ``hps serve`` (two workers, the edges' configuration) serves a
model and its version 1 while writers update both, readers look up with and without naming a version, a labeler
switches ``production`` every 0.3 s, and the owner is SIGKILLed and restarted once. Every read is checked against
its version's history (stale reads, lost updates, resurrections, other keys' rows) and against the label rule (see
:mod:`tests.history.labels`)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.history.labels import AUTH, LabelWorkload, check_labels
from tests.history.model import check
from tests.history.server import HistoryServer
from tests.history.workload import key_space

SECONDS = float(os.environ.get("HPS_LABEL_HISTORY_SECONDS", "16"))


@pytest.mark.timeout(SECONDS + 300)
def test_label_switches_and_versions_keep_the_history_rules(kafka_broker, tmp_path: Path) -> None:
    server = HistoryServer(tmp_path, kafka_broker.bootstrap, topic_prefix=f"labels-{uuid.uuid4().hex[:10]}")
    server.start()
    try:
        added = httpx.post(f"{server.http}/v1/models/hist/versions", json={"version": 1}, headers=AUTH, timeout=60)
        assert added.status_code == 201, added.text
        workload = LabelWorkload(server, key_space(64))
        threads = workload.threads()
        for th in threads:
            th.start()
        time.sleep(SECONDS / 2)
        server.kill()  # mid-run: writes, reads and switches in flight fail; the label must survive the restart
        server.start()
        # the version registered at runtime is served again (the node's owner loads the stored registrations)
        assert httpx.get(f"{server.http}/v1/models/hist", timeout=10).json()["versions"] == [1]
        time.sleep(SECONDS / 2)
        workload.stop.set()
        for th in threads:
            th.join(60)
    finally:
        assert server.stop() == 0, server.log_path.read_text()[-4000:]
    assert not workload.errors, workload.errors[:5]
    violations = {v: check(h) for v, h in workload.histories.items()}
    label_violations = check_labels(workload.switches, workload.reads)
    acked = [s for s in workload.switches if s.ack is not None]
    answered = {r.answered for r in workload.reads if r.asked < 0}
    print(f"answers other than 200: {workload.refusals}")
    print(f"{len(workload.reads)} reads, {len(acked)} of {len(workload.switches)} switches acknowledged, "
          + ", ".join(f"version {v}: {h.counts()}" for v, h in workload.histories.items()))
    assert not any(violations.values()), {v: [str(x) for x in vs[:5]] for v, vs in violations.items()}
    assert not label_violations, label_violations[:5]
    assert len(acked) >= 5 and answered == {0, 1}, (len(acked), answered)
    assert all(h.counts().get("acknowledged writes", 0) > 0 for h in workload.histories.values())
