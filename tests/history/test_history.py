"""The history checker against real processes (issues 14 and 27): ``hps serve`` with two workers at the edges of its
hierarchy (RocksDB flushing all the time, workers reading it through their secondary instances, change rings lapped
by large batches, LocalClient readers beside gRPC readers; see :mod:`tests.history.server`), Kafka and REST writers,
imports; the owner SIGKILLed while it ingests and a replica SIGKILLed while it bootstraps from a snapshot; then the
three properties, on the primary's reads and on the replica's.

``make test`` runs it for HPS_HISTORY_SECONDS (default 40 s); the ``long`` one (HPS_RUN_LONG=1, ``make history``)
for HPS_HISTORY_LONG_SECONDS (default 360 s; the lifecycle's check takes the rest of its 10 minutes).
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.history.complete import CompleteWatch
from tests.history.faults import Faults, ring_laps
from tests.history.model import History, Violation, check, check_tiers_agree
from tests.history.report import report, stored_versions, topic_log
from tests.history.server import HistoryServer
from tests.history.workload import Workload, key_space

#: How often the primary uploads a snapshot (a RocksDB checkpoint, which flushes every memtable) for the replica.
SNAPSHOT_INTERVAL_S = 4.0


def _violations(history: History, passes: dict[str, np.ndarray], stored: np.ndarray, keys: np.ndarray
                ) -> list[Violation]:
    return check(history) + check_tiers_agree(keys, passes, stored)


def run_history(broker: str, s3_server, workdir: Path, seconds: float, *, replica: bool = True,
                kill_owner_at: tuple[float, ...] = (0.5,), complete: bool = False) -> str:
    """One run; returns its report (asserts no violation). ``complete``: the default ``cache.enabled: auto`` (no L1:
    the compiled pass) and a hash map that holds the keys the run picks from until it widens them (see
    :func:`test_history_of_a_complete_table_has_no_violation`)."""
    model = f"h{uuid.uuid4().hex[:10]}"
    store = f"s3://{s3_server.new_bucket()}/h"
    snapshots = {"snapshot_store": store, "snapshot_interval_s": SNAPSHOT_INTERVAL_S}
    lane = {"cache": {"enabled": "auto"}, "volatile": {"capacity_rows": COMPLETE_ROWS}} if complete else {}
    primary = HistoryServer(workdir / "primary", broker, model=model, env=s3_server.env, name="primary",
                            overrides={"persistent": snapshots, **lane})
    second = HistoryServer(workdir / "replica", broker, model=model, env=s3_server.env, name="replica",
                           overrides={"persistent": {"snapshot_store": store}, "server": {
                               "workers": 1, "local": {"enabled": False}}, **lane}) if replica else None
    keys = key_space(2000)
    began = time.monotonic()
    primary.start()
    phases = {"start": time.monotonic() - began}
    workload = Workload(primary, keys, **({"import_every_s": 2.0} if complete else {}))
    workload.reach = NARROW_REACH if complete else 1.0
    faults = Faults(workload, primary, second, seconds, kill_owner_at=kill_owner_at,
                    replica_at=0.15 if replica else None)
    watch = CompleteWatch(primary, lambda: sum(w.via == "import" and w.ack is not None
                                               for w in workload.history.writes)) if complete else None
    widened_at = float("inf")
    try:
        workload.start()
        threads = faults.start()
        if watch is not None:
            watch.start()
            if not workload.stopped.wait(WIDEN_AT * seconds):
                widened_at, workload.reach = time.monotonic(), 1.0  # new keys past the hash map's rows: evictions
        workload.stopped.wait(seconds - (time.monotonic() - began - phases["start"]))
        for thread in threads:
            thread.join(300)
        phases["workload"] = time.monotonic() - began - phases["start"]
        assert not any(t.is_alive() for t in threads) and not faults.errors, f"{faults.errors}: {faults.crashes}"
        workload.finish()
        phases["applied"] = time.monotonic() - began - sum(phases.values())
        laps = faults.laps_before_restarts + ring_laps(primary)
        passes = workload.final_passes(primary)
        assert not workload.errors and not faults.errors, workload.errors + faults.errors
        replica_passes = workload.final_passes(second, via="replica-final") if workload.replica is not None else {}
    finally:
        assert primary.stop() == 0, primary.log_path.read_text()[-4000:]
        if second is not None and second.proc is not None:
            assert second.stop() == 0, second.log_path.read_text()[-4000:]
    phases["final passes and stops"] = time.monotonic() - began - sum(phases.values())
    table_id = f"{model}.{primary.table}"
    violations = _violations(workload.history, passes, stored_versions(primary.db, table_id, keys), keys)
    edges = {"flushes": primary.flushes() + (second.flushes() if second is not None else 0), "ring laps": laps,
             "crashes": len(faults.crashes), "lulls with a snapshot": workload.lulls,
             "calls failed while a server was down": workload.failed_calls}
    if watch is not None:
        watch.stop()
        edges.update(watch.summary(widened_at))
    text = report(workload.history, violations, workload.t0, edges)
    text += "".join(f"\n  {c}" for c in faults.crashes)
    text += "\nseconds: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
    replica_violations: list[Violation] = []
    if second is not None and workload.replica is not None:
        rh = workload.replica_history()
        replica_violations = _violations(rh, replica_passes, stored_versions(second.db, table_id, keys), keys)
        text += "\nreplica " + report(rh, replica_violations, workload.t0)
    bad_keys = np.unique(np.array([v.key for v in violations + replica_violations], dtype=np.int64))[:5]
    if bad_keys.size:
        text += f"\nthe update topic's messages for keys {bad_keys.tolist()}:\n" + topic_log(broker, model, bad_keys)
        with open(workdir / "history.pkl", "wb") as f:  # pickle.load(f) -> (writes, reads, violations, t0)
            pickle.dump((workload.history.writes, workload.history.reads, violations + replica_violations,
                         workload.t0), f)
        text += f"\nhistory saved to {workdir / 'history.pkl'}"
    if workload.unlogged_writes:
        text += "\nREST writes acknowledged without the update topic:\n  " + "\n  ".join(workload.unlogged_writes)
    if workload.kafka_hiccups:
        text += f"\n{len(workload.kafka_hiccups)} Kafka calls timed out (those writes count as unacknowledged)"
    print(text)
    assert not workload.errors and not faults.errors, workload.errors + faults.errors
    assert workload.history.counts()["acknowledged writes"] > 0
    assert len(faults.crashes) == len(kill_owner_at) + replica, faults.crashes
    assert not replica or workload.replica_reads, "the replica was never read"
    assert not violations and not replica_violations and not workload.unlogged_writes, text
    if complete:  # every event the complete state goes through happened while the readers read
        assert edges["starts complete"] == len(kill_owner_at) + 1, text  # each start, once its preload ended
        assert edges["imports kept complete"] >= 1 and edges["losses with evictions after widening"] >= 1, text
    return text


#: The complete-table run: a hash map of this many rows, the keys picked from the first ``NARROW_REACH`` of the
#: 2000 (1100: they fit) until ``WIDEN_AT`` of the run, then from all of them (they do not: evictions).
COMPLETE_ROWS, NARROW_REACH, WIDEN_AT = 1300, 0.55, 0.6
SECONDS = float(os.environ.get("HPS_HISTORY_SECONDS", "25"))
#: The complete-table run needs the owner's restart and the preload after it inside the run.
COMPLETE_SECONDS = max(SECONDS, 40.0)
LONG_SECONDS = float(os.environ.get("HPS_HISTORY_LONG_SECONDS", "360"))


@pytest.mark.timeout(SECONDS + 400)
def test_history_has_no_violation(kafka_broker, s3_server, tmp_path: Path) -> None:
    run_history(kafka_broker.bootstrap, s3_server, tmp_path, SECONDS)


@pytest.mark.timeout(COMPLETE_SECONDS + 400)
def test_history_of_a_complete_table_has_no_violation(kafka_broker, s3_server, tmp_path: Path) -> None:
    """The complete state (issue 52) under the same writers, readers and faults, without L1 (the default on a CPU):
    the table is complete from its empty start, imports that fit keep it, the owner's restart loses it until the
    preload ends, and widening the keys past the hash map's rows loses it by evictions; every read stays right."""
    run_history(kafka_broker.bootstrap, s3_server, tmp_path, COMPLETE_SECONDS, kill_owner_at=(0.3,), complete=True)


@pytest.mark.long
@pytest.mark.timeout(LONG_SECONDS + 900)
def test_long_history_has_no_violation(kafka_broker, s3_server, tmp_path: Path) -> None:
    run_history(kafka_broker.bootstrap, s3_server, tmp_path, LONG_SECONDS, kill_owner_at=(0.2, 0.4, 0.6, 0.8))
