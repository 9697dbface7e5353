"""The history checker against real processes (issue 14): ``hps serve`` (small L1, small hash map, RocksDB, Kafka
updates from the tansu broker), Kafka and REST writers, imports and gRPC readers at once; then the three properties.

``make test`` runs it for HPS_HISTORY_SECONDS (default 40 s); the ``long`` one (HPS_RUN_LONG=1, ``make history``)
for HPS_HISTORY_LONG_SECONDS (default 600 s).
"""

from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.history.model import check, check_tiers_agree
from tests.history.workload import HistoryServer, Workload, key_space, report


def run_history(broker: str, workdir: Path, seconds: float, **overrides: dict) -> None:
    server = HistoryServer(workdir, broker, model=f"h{uuid.uuid4().hex[:10]}", overrides=overrides)
    keys = key_space(2000)
    server.start()
    try:
        workload = Workload(server, keys)
        workload.run(seconds)
        passes = workload.final_passes()
    finally:
        assert server.stop() == 0, (workdir / "server.log").read_text()[-4000:]
    violations = check(workload.history) + check_tiers_agree(keys, passes, workload.stored_versions())
    text = report(workload.history, violations, workload.t0)
    if violations:
        bad = np.unique(np.array([v.key for v in violations], dtype=np.int64))[:5]
        text += f"\nthe update topic's messages for keys {bad.tolist()}:\n" + workload.topic_log(bad)
    print(text + (f"\n{len(workload.kafka_hiccups)} Kafka calls timed out (those writes count as unacknowledged)"
                  if workload.kafka_hiccups else ""))
    if violations:  # for a look afterwards: pickle.load(open(path, "rb")) -> (history, violations, t0)
        with open(workdir / "history.pkl", "wb") as f:
            pickle.dump((workload.history.writes, workload.history.reads, violations, workload.t0), f)
        print(f"history saved to {workdir / 'history.pkl'}")
    assert not workload.errors, workload.errors
    assert workload.history.counts()["acknowledged writes"] > 0
    assert not violations, text


SECONDS = float(os.environ.get("HPS_HISTORY_SECONDS", "40"))
LONG_SECONDS = float(os.environ.get("HPS_HISTORY_LONG_SECONDS", "600"))


@pytest.mark.timeout(SECONDS + 300)
def test_history_has_no_violation(kafka_broker, tmp_path: Path) -> None:
    """With two gRPC worker processes over the owner's shared store, whatever the machine's CPUs (the default)."""
    run_history(kafka_broker.bootstrap, tmp_path, SECONDS, server={"workers": 2})


@pytest.mark.long
@pytest.mark.timeout(LONG_SECONDS + 600)
def test_long_history_has_no_violation(kafka_broker, tmp_path: Path) -> None:
    run_history(kafka_broker.bootstrap, tmp_path, LONG_SECONDS)
