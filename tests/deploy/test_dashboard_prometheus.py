"""The Grafana dashboard against a real Prometheus: it scrapes a real `hps serve` (and the working set of its
container, as cAdvisor exports it) while lookups and Kafka updates flow, and every panel query of
deploy/grafana/hps-dashboard.json runs through Prometheus's HTTP API with Grafana's variables substituted: first on
a healthy system (nothing failed: every panel shows 0 rather than No data), then after faults (a malformed update,
callers' NOT_FOUND mistakes), when each must return data again, the malformed panel counting the message and the
Errors panel still 0 (it counts what the error alert counts, not callers' mistakes). The live /metrics passes
`promtool check metrics`."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from confluent_kafka import Producer

from hps_service.client import HPSClient
from hps_service.errors import HPSError, NotFoundError
from hps_service.updates import Publisher, make_version
from hps_service.updates.message import topic_name
from tests.fixtures.cadvisor import cadvisor_exporter
from tests.fixtures.prometheus import promtool, running_prometheus
from tests.helpers import REPO, ServerProcess, free_port, write_config

DASHBOARD = REPO / "deploy" / "grafana" / "hps-dashboard.json"
MODEL, PREFIX, DIM = "dash", "dashboard", 8
LABELS = {"namespace": "ml", "pod": "hps-0"}
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval gives for a 1 s scrape interval at this zoom


def grafana_substitute(expr: str) -> str:
    """The query as Grafana sends it with namespace ml, pod hps-0 and model dash selected."""
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", LABELS["namespace"])
            .replace("$pod", LABELS["pod"]).replace("$model", MODEL))


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(f"{p['title']} [{t['refId']}]", grafana_substitute(t["expr"]))
            for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def _traffic(client: HPSClient, publisher: Publisher, stop: threading.Event, errors: list[str],
             mistakes: threading.Event) -> None:
    """Updates every 0.2 s, lookups, and once ``mistakes`` is set one NOT_FOUND per round (a caller's mistake)."""
    keys = np.arange(1, 501, dtype=np.int64)
    step = 0
    while not stop.is_set():
        step += 1
        try:
            publisher.publish("item", keys, np.full((keys.size, DIM), step, dtype=np.float32), make_version(0, step))
            publisher.flush(10)
            for i in range(10):
                client.lookup(MODEL, "item", keys[(i * 50) % 500:(i * 50) % 500 + 64])
            if mistakes.is_set():
                try:
                    client.lookup(MODEL, "missing", [1])
                except NotFoundError:
                    pass
        except HPSError as exc:  # a slow moment of a loaded machine: noted, the traffic goes on
            errors.append(repr(exc))
        stop.wait(0.2)


def test_every_panel_query_returns_data_from_a_real_prometheus(kafka_broker, tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port},
        "cache": {"enabled": True, "backend": "numpy", "capacity": 64, "min_rows": 64, "admit_after_misses": 1},
        "volatile": {"type": "hashmap", "capacity_rows": 200},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "updates": {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": PREFIX, "group": "dash-0"},
        "models": [{"name": MODEL, "tables": [{"name": "item", "dim": DIM}]}],
    })
    publisher = Publisher(kafka_broker.bootstrap, MODEL, topic_prefix=PREFIX)
    stop, mistakes = threading.Event(), threading.Event()
    errors: list[str] = []
    with ServerProcess(cfg, grpc_port) as srv, HPSClient(srv.target, timeout=30) as client, \
            cadvisor_exporter(srv.proc.pid) as cadvisor, \
            running_prometheus(tmp_path, [f"127.0.0.1:{http_port}", cadvisor], LABELS) as prom:
        traffic = threading.Thread(target=_traffic, args=(client, publisher, stop, errors, mistakes), daemon=True)
        traffic.start()
        try:
            metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text
            checked = subprocess.run([promtool(), "check", "metrics"], input=metrics, capture_output=True,
                                     text=True, timeout=60)
            assert checked.returncode == 0, checked.stdout + checked.stderr
            queries = panel_queries()
            assert len(queries) >= 30
            healthy = _answered(prom, queries)
            assert healthy["missing"] == {}, f"panels without data on a healthy system: {healthy['missing']}"
            assert healthy["values"]["Errors [A]"] == 0 and healthy["values"]["Malformed updates/s [A]"] == 0
            raw = Producer({"bootstrap.servers": kafka_broker.bootstrap})
            raw.produce(topic_name(MODEL, PREFIX), b"not an update message", key=b"\0" * 8)
            raw.flush(10)
            mistakes.set()
            faults = _answered(prom, queries, until=lambda v: v["Malformed updates/s [A]"] > 0)
            for variable in ("namespace", "pod", "model"):
                values = httpx.get(f"{prom}/api/v1/label/{variable}/values",
                                   params={"match[]": "hps_tier_hits_total"}, timeout=10).json()["data"]
                assert values == [{**LABELS, "model": MODEL}[variable]], (variable, values)
        finally:
            stop.set()
            traffic.join(30)
            publisher.close()
    print(f"\n{len(queries)} panel queries answered with data, healthy and after faults; traffic errors: {errors[:3]}")
    assert faults["missing"] == {}, f"panel queries without data: {json.dumps(faults['missing'], indent=1)}"
    assert faults["values"]["Malformed updates/s [A]"] > 0
    assert faults["values"]["Errors [A]"] == 0, "NOT_FOUND (a caller's mistake) counted as a server error"
    assert faults["values"]["Memory by pod: working set and shared store [A]"] > 0
    assert faults["values"]["Memory by pod: working set and shared store [B]"] > 0
    assert 'hps_build_info{version="' in metrics


def _answered(prom: str, queries: list[tuple[str, str]], until: Any = None, timeout: float = 60) -> dict[str, Any]:
    """Run every query until each returns data (and ``until(values)`` holds), or ``timeout``; the queries still
    without data and the largest value of each."""
    deadline = time.monotonic() + timeout
    while True:
        missing, values = {}, {}
        for title, query in queries:
            r = httpx.get(f"{prom}/api/v1/query", params={"query": query}, timeout=10).json()
            assert r["status"] == "success", (title, query, r)
            if r["data"]["result"]:
                values[title] = max(float(series["value"][1]) for series in r["data"]["result"])
            else:
                missing[title] = query
        if (not missing and (until is None or until(values))) or time.monotonic() > deadline:
            return {"missing": missing, "values": values}
        time.sleep(1.0)
