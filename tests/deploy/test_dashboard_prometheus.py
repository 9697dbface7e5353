"""The Grafana dashboard against a real Prometheus: it scrapes a real `hps serve` while lookups (a few of them
failing) and Kafka updates (one malformed) flow, then every panel query of deploy/grafana/hps-dashboard.json runs
through Prometheus's HTTP API with Grafana's variables substituted, and each must return data. The live /metrics
passes `promtool check metrics`."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from confluent_kafka import Producer

from hps_service.client import HPSClient
from hps_service.errors import HPSError, NotFoundError
from hps_service.updates import Publisher, make_version
from hps_service.updates.message import topic_name
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


def _traffic(client: HPSClient, publisher: Publisher, stop: threading.Event, errors: list[str]) -> None:
    """Updates every 0.2 s, lookups, and one NOT_FOUND per round (a caller's mistake, for the error panels)."""
    keys = np.arange(1, 501, dtype=np.int64)
    step = 0
    while not stop.is_set():
        step += 1
        try:
            publisher.publish("item", keys, np.full((keys.size, DIM), step, dtype=np.float32), make_version(0, step))
            publisher.flush(10)
            for i in range(10):
                client.lookup(MODEL, "item", keys[(i * 50) % 500:(i * 50) % 500 + 64])
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
        "cache": {"backend": "numpy", "capacity": 64, "min_rows": 64, "admit_after_misses": 1},
        "volatile": {"type": "hashmap", "capacity_rows": 200},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "updates": {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": PREFIX, "group": "dash-0"},
        "models": [{"name": MODEL, "tables": [{"name": "item", "dim": DIM}]}],
    })
    publisher = Publisher(kafka_broker.bootstrap, MODEL, topic_prefix=PREFIX)
    stop = threading.Event()
    errors: list[str] = []
    with ServerProcess(cfg, grpc_port) as srv, HPSClient(srv.target, timeout=30) as client, \
            running_prometheus(tmp_path, [f"127.0.0.1:{http_port}"], LABELS) as prom:
        raw = Producer({"bootstrap.servers": kafka_broker.bootstrap})
        raw.produce(topic_name(MODEL, PREFIX), b"not an update message", key=b"\0" * 8)
        raw.flush(10)
        traffic = threading.Thread(target=_traffic, args=(client, publisher, stop, errors), daemon=True)
        traffic.start()
        try:
            metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text
            checked = subprocess.run([promtool(), "check", "metrics"], input=metrics, capture_output=True,
                                     text=True, timeout=60)
            assert checked.returncode == 0, checked.stdout + checked.stderr
            missing: dict[str, str] = {}
            deadline = time.monotonic() + 60
            queries = panel_queries()
            assert len(queries) >= 30
            while True:
                missing = {}
                for title, query in queries:
                    r = httpx.get(f"{prom}/api/v1/query", params={"query": query}, timeout=10).json()
                    assert r["status"] == "success", (title, query, r)
                    if not r["data"]["result"]:
                        missing[title] = query
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            for variable in ("namespace", "pod", "model"):
                values = httpx.get(f"{prom}/api/v1/label/{variable}/values",
                                   params={"match[]": "hps_tier_hits_total"}, timeout=10).json()["data"]
                assert values == [{**LABELS, "model": MODEL}[variable]], (variable, values)
        finally:
            stop.set()
            traffic.join(30)
            publisher.close()
    print(f"\n{len(queries)} panel queries answered with data; traffic errors: {errors[:3]}")
    assert missing == {}, f"panel queries without data: {json.dumps(missing, indent=1)}"
    assert 'hps_build_info{version="' in metrics
