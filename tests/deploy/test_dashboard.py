"""The Grafana dashboard: well-formed, every query parses as PromQL, and every metric it reads is one the
server really exports (taken from the prometheus-client objects in hps_service and the process collector)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import promql_parser
import pytest
from prometheus_client import REGISTRY

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "hps-dashboard.json"
METRIC_NAME = re.compile(r"\b((?:hps|process)_[a-z0-9_]+)\b")
# The series each prometheus-client type exposes for a metric named N.
SUFFIXES = {
    "Counter": ("_total",), "CounterMetricFamily": ("_total",),
    "Histogram": ("_bucket", "_sum", "_count"), "HistogramMetricFamily": ("_bucket", "_sum", "_count"),
    "Gauge": ("",), "GaugeMetricFamily": ("",),
}


def exported_series() -> set[str]:
    """Series names the server's code registers: first argument of each metric constructor in hps_service."""
    names: set[str] = set()
    for path in (REPO / "hps_service").rglob("*.py"):
        if "proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            first = node.args[0]
            if func in SUFFIXES and isinstance(first, ast.Constant) and isinstance(first.value, str):
                base = first.value.removesuffix("_total") if "Counter" in func else first.value
                names.update(base + suffix for suffix in SUFFIXES[func])
    for family in REGISTRY.collect():
        names.update(sample.name for sample in family.samples)
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


def _as_promql(expr: str) -> str:
    """The query as Prometheus receives it once Grafana has substituted its variables."""
    return expr.replace("$__rate_interval", "1m").replace("$namespace", ".*").replace("$pod", ".*") \
        .replace("$model", ".*")


def test_layout_ids_and_datasource(dashboard: dict) -> None:
    assert dashboard["uid"] == "hps-service" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        covered = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not covered & cells, f"panel {panel['title']} overlaps another"
        cells |= covered
    for panel in _panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    used = {m for e in _exprs(dashboard) for m in re.findall(r"\$(\w+)", e)} - {"__rate_interval"}
    assert used <= variables


def test_every_query_parses_as_promql(dashboard: dict) -> None:
    exprs = _exprs(dashboard) + [v["definition"].removeprefix("label_values(").rsplit(",", 1)[0]
                                 for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for expr in exprs:
        promql_parser.parse(_as_promql(expr))
    with pytest.raises(ValueError):
        promql_parser.parse(_as_promql("sum(rate(hps_lookup_requests_total[$__rate_interval])"))


def test_every_metric_is_exported_by_the_server(dashboard: dict) -> None:
    exported = exported_series()
    assert {"hps_lookup_requests_total", "hps_lookup_latency_seconds_bucket"} <= exported
    text = json.dumps(dashboard["panels"]) + json.dumps(dashboard["templating"])
    missing = sorted(set(METRIC_NAME.findall(text)) - exported)
    assert missing == [], f"the dashboard reads series nothing exports: {missing}"


@pytest.mark.parametrize("needle,what", [
    ("rate(hps_lookup_requests_total", "QPS"),
    ("histogram_quantile(0.5, sum by (le, method) (rate(hps_lookup_latency_seconds_bucket", "p50 latency"),
    ("histogram_quantile(0.99, sum by (le, method) (rate(hps_lookup_latency_seconds_bucket", "p99 latency"),
    ("sum by (tier) (rate(hps_tier_hits_total", "hit rate per tier"),
    ("hps_update_lag_seconds_bucket", "freshness"),
    ("hps_consumer_lag_messages", "consumer lag"),
    ("rate(hps_cache_evictions_total", "evictions"),
])
def test_dashboard_shows(dashboard: dict, needle: str, what: str) -> None:
    assert any(needle in e for e in _exprs(dashboard)), f"no panel shows {what}"


def test_error_panel_counts_what_the_alert_counts(dashboard: dict) -> None:
    """The Errors stat divides the statuses of the chart's HPSLookupErrorRatioHigh (metrics.prometheusRule.
    errorStatuses) by all lookups; both sides fall back to 0 when no series exists yet (no "No data")."""
    import yaml

    values = yaml.safe_load((REPO / "deploy" / "helm" / "hps" / "values.yaml").read_text())
    statuses = values["metrics"]["prometheusRule"]["errorStatuses"]
    (errors,) = [p for p in _panels(dashboard) if p["title"] == "Errors"]
    expr = errors["targets"][0]["expr"]
    assert f'status=~"{statuses}"' in expr and expr.count("or vector(0)") == 2
    memory = next(p for p in _panels(dashboard) if p["title"].startswith("Memory"))
    exprs = [t["expr"] for t in memory["targets"]]
    assert "container_memory_working_set_bytes" in exprs[0] and "hps_node_shared_memory_bytes" in exprs[1]
    (axis,) = memory["fieldConfig"]["overrides"]
    assert axis["matcher"]["options"] == "B" and {"id": "custom.axisPlacement", "value": "right"} in axis["properties"]
