"""The lifecycle in the history checker (issue 57): ``hps serve`` (two workers, a colocated store, the edges'
configuration: a tiny hash map and L1, so rows come from RocksDB through the workers' secondaries) while versions are
added, dropped, added again and retired, the model's table is converted between formats and the model replaced, and
the label ``production`` switches; writers put and delete, readers look up through gRPC, LocalClient and REST. Every
read is checked by the rules of :mod:`tests.history.lifecycle`; no worker may die. It runs again without L1 (the
default on a CPU), where every table is complete (issue 52) and the conversions lose that state.

``make test`` runs it for HPS_LIFECYCLE_HISTORY_SECONDS (default 30 s); ``make history`` for
HPS_LIFECYCLE_LONG_SECONDS (default 240 s) after the main check.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.history.lifecycle import DIM, KEEP_VERSIONS, LifecycleWorkload
from tests.history.model import DEFAULT_VALUE, key_history
from tests.history.server import HistoryServer
from tests.history.workload import key_space


def run_lifecycle(workdir: Path, seconds: float, l1: bool = True) -> str:
    """One run; ``l1`` False: the default ``cache.enabled: auto`` (the compiled pass), whose hash map holds the 96
    keys: every version's table is complete once loaded, and each conversion loses it until the copy's preload."""
    model = f"life{uuid.uuid4().hex[:8]}"
    overrides: dict = {"updates": {"type": "disabled"}}
    if not l1:
        overrides["cache"] = {"enabled": "auto"}
    server = HistoryServer(workdir, "", model=model, overrides=overrides, models=[
        {"name": model, "keep_versions": KEEP_VERSIONS,
         "tables": [{"name": "t", "dim": DIM, "default": {"constant": DEFAULT_VALUE}}]}])
    server.start()
    workload = LifecycleWorkload(server, key_space(96))
    threads = workload.threads()
    began = time.monotonic()
    complete_seen = 0
    try:
        for th in threads:
            th.start()
        while not workload.stop.wait(0.25) and time.monotonic() - began < seconds:
            answer = httpx.get(f"{server.http}/v1/stats", timeout=30)
            assert answer.status_code == 200, answer.text  # a table dropped meanwhile is left out, not a 404
            table = answer.json()["models"][model]["tables"]["t"]
            complete_seen += bool(table["volatile"].get("complete"))
        workload.stop.set()
        for th in threads:
            th.join(120)
        node = httpx.get(f"{server.http}/v1/stats", timeout=30).json()["node"]
    finally:
        assert server.stop() == 0, server.log_path.read_text()[-4000:]
    elapsed = time.monotonic() - began
    violations = workload.check()
    counts, events = workload.counts(), workload.events
    text = (f"lifecycle history: {counts} in {elapsed:.0f} s; {events.adds} adds ({events.re_adds} of a number "
            f"served before), {events.drops} drops, {events.retired} retired by keep_versions, {events.conversions} "
            f"conversions, {events.replaces} replaces, {events.switches} label switches; refused: {events.refused}; "
            f"worker restarts: {node['restarts']}; {len(violations)} violations")
    errors = [line for line in server.log_path.read_text().splitlines() if " ERROR " in line]
    if errors:
        text += "\nthe server logged errors:\n" + "\n".join(errors[:10])
    for inc, v in violations[:10]:
        text += f"\nVIOLATION key {v.key}: {v.rule}: {v.detail}" + (f" at {v.at:.3f}" if v.at else "")
        if inc is not None:
            text += (f"\n in version {inc.number} as added at {inc.added:.3f} (dropped at {inc.dropped}):\n"
                     + key_history(inc.history, v.key, 0.0, limit=30, at=v.at))
    print(text)
    assert not workload.errors, workload.errors[:5]
    assert node["restarts"] == 0 and not node["given_up"], f"a worker died: {node}"
    assert not violations, text
    assert events.re_adds and events.drops and events.switches and events.replaces, text
    assert events.conversions or seconds < 20, text
    assert l1 or complete_seen, "the model's table was never complete"
    return text


def test_lifecycle_keeps_the_history_rules(tmp_path: Path) -> None:
    run_lifecycle(tmp_path, float(os.environ.get("HPS_LIFECYCLE_HISTORY_SECONDS", "30")))


def test_lifecycle_of_complete_tables_keeps_the_history_rules(tmp_path: Path) -> None:
    run_lifecycle(tmp_path, float(os.environ.get("HPS_LIFECYCLE_HISTORY_SECONDS", "30")), l1=False)


@pytest.mark.long
@pytest.mark.skipif(not os.environ.get("HPS_RUN_LONG"), reason="make history runs it (HPS_RUN_LONG=1)")
def test_lifecycle_keeps_the_history_rules_long(tmp_path: Path) -> None:
    run_lifecycle(tmp_path, float(os.environ.get("HPS_LIFECYCLE_LONG_SECONDS", "240")))
