"""What the chart gives an operator beyond the workload: its README and values table, the `helm test` hook, a runbook
for every alert, soft zone spread, the pods' RuntimeClass and the ServiceMonitor's relabelings. Rendered by Helm's Go
engine (helm-python-sdk), as in test_chart.py; the hook's command runs against a real server in
test_chart_serves.py."""

from __future__ import annotations

import re
from pathlib import Path

import helm_python
import pytest
import yaml

from tests.deploy.test_chart import ALL_FEATURES, GPU_EXAMPLE, SHARDED, _load, check_chart

REPO = Path(__file__).resolve().parents[2]
chart_readme = _load("chart_readme", REPO / "deploy" / "chart_readme.py")
RUNBOOKS = REPO / "docs" / "runbooks.md"
EXTRA_SPREAD = {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "hps"}}}
#: Values that change what these tests look at, rendered once each.
CHANGED = {"runtimeClassName": "gvisor", "topologySpreadConstraints": [EXTRA_SPREAD],
           "metrics": {"prometheusRule": {"enabled": True, "runbookBaseUrl": "https://wiki.example/hps"},
                       "serviceMonitor": {"enabled": True}}}
OFF = {"zoneSpread": {"enabled": False}, "helmTest": {"enabled": False}}


@pytest.fixture(scope="module")
def renders() -> dict[str, check_chart.Rendered]:
    values = {"defaults": {}, "all": check_chart.load_values(ALL_FEATURES), "sharded": check_chart.load_values(SHARDED),
              "gpu": check_chart.load_values(GPU_EXAMPLE), "changed": CHANGED, "off": OFF}
    return {name: check_chart.render(v) for name, v in values.items()}


def _pod_spec(rendered: check_chart.Rendered, name: str | None = None) -> dict:
    return rendered.one("StatefulSet", name)["spec"]["template"]["spec"]


def test_the_readme_is_generated_from_the_schema_and_current() -> None:
    assert chart_readme.main([]) == 0, "run: python deploy/chart_readme.py --write"
    readme = helm_python.show(str(check_chart.CHART_DIR), output_format="readme")
    assert readme.rstrip("\n") == chart_readme.README.read_text().rstrip("\n")  # helm adds a newline
    for key in ("replicaCount", "zoneSpread.enabled", "helmTest.keys", "metrics.prometheusRule.runbookBaseUrl",
                "metrics.serviceMonitor.relabelings", "runtimeClassName"):
        (row,) = [line for line in readme.splitlines() if line.startswith(f"| `{key}` |")]
        assert row.count(" | ") == 3 and not row.endswith("|  |"), row  # type, default, description
    assert "| `config` | object | see values.yaml |" in readme


def test_a_value_without_a_description_is_refused() -> None:
    schema = {"properties": {"a": {"type": "object", "properties": {"b": {"type": "string"},
                                                                    "c": {"type": "integer", "description": "x"}}}}}
    assert chart_readme.undocumented(schema) == ["a.b"]
    assert chart_readme.rows(schema, {"a": {"b": "v", "c": 3}}) == [("a.b", "string", '`"v"`', ""),
                                                                    ("a.c", "integer", "`3`", "x")]


def test_every_alert_links_its_runbook(renders) -> None:
    rules = renders["all"].one("PrometheusRule")["spec"]["groups"]
    alerts = [r for g in rules for r in g["rules"] if "alert" in r]
    base_url = yaml.safe_load((check_chart.CHART_DIR / "values.yaml").read_text())["metrics"]["prometheusRule"][
        "runbookBaseUrl"]
    assert base_url.endswith("/docs/runbooks.md")
    text = RUNBOOKS.read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    assert {a["alert"] for a in alerts} == set(sections)  # a runbook per alert, none for an alert that is gone
    for alert in alerts:
        name = alert["alert"]
        assert alert["annotations"]["runbook_url"] == f"{base_url}#{name.lower()}"  # GitHub's anchor of "## Name"
        for part in ("**What it means.**", "**How to check.**", "**What to do.**"):
            assert part in sections[name], f"{name}: no {part}"
    urls = {r["annotations"]["runbook_url"] for g in renders["changed"].one("PrometheusRule")["spec"]["groups"]
            for r in g["rules"] if "alert" in r}
    assert urls == {f"https://wiki.example/hps#{a['alert'].lower()}" for a in alerts}


def test_pods_spread_softly_over_zones_by_default(renders) -> None:
    defaults = renders["defaults"]
    (spread,) = _pod_spec(defaults)["topologySpreadConstraints"]
    assert spread == {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
                      "labelSelector": {"matchLabels": defaults.one("StatefulSet")["spec"]["selector"]["matchLabels"]}}
    for sts in renders["sharded"].find("StatefulSet"):
        (spread,) = sts["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["labelSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]  # its own shard
    both = _pod_spec(renders["changed"])["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in both] == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    assert both[1] == EXTRA_SPREAD
    assert "topologySpreadConstraints" not in _pod_spec(renders["off"])
    report = check_chart.Report("zone spread off, no helm test")
    check_chart.validate_schemas(renders["off"], report, versions=check_chart.KUBE_VERSIONS[-1:])
    assert report.problems == []


def test_runtime_class_name(renders) -> None:
    assert "runtimeClassName" not in _pod_spec(renders["defaults"])
    assert _pod_spec(renders["changed"])["runtimeClassName"] == "gvisor"
    assert _pod_spec(renders["gpu"])["runtimeClassName"] == "nvidia"


def test_service_monitor_relabelings(renders) -> None:
    (endpoint,) = renders["all"].one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_label_hps_shard"], "targetLabel": "shard", "action": "replace"},
        {"targetLabel": "cluster", "replacement": "prod-eu"}]
    assert endpoint["metricRelabelings"] == [{"sourceLabels": ["__name__"], "regex": "go_.*", "action": "drop"}]
    (plain,) = renders["changed"].one("ServiceMonitor")["spec"]["endpoints"]
    assert len(plain["relabelings"]) == 1 and "metricRelabelings" not in plain


def hook_command(rendered: check_chart.Rendered) -> list[str]:
    """The command of the `helm test` pod (checked to be a test hook that looks keys up with `hps lookup`)."""
    (pod,) = rendered.find("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == rendered.find("StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert container["command"][:2] == ["hps", "lookup"]
    return container["command"]


def _targets(command: list[str]) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == "--target"]


def test_the_helm_test_hook_looks_keys_up_through_the_service(renders) -> None:
    rendered = renders["defaults"]
    command = hook_command(rendered)
    service = rendered.one("Service", "hps")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert _targets(command) == [f"hps.{check_chart.NAMESPACE}.svc:{port}"]
    assert command[command.index("--model") + 1:command.index("--table") + 2] == ["demo", "--table", "item"]
    assert command[-3:] == ["1", "2", "3"]
    sharded = renders["sharded"]
    assert len(_targets(hook_command(sharded))) == len(sharded.find("StatefulSet")) == 2
    assert all(t.startswith("dns:///") for t in _targets(hook_command(sharded)))
    assert not renders["off"].find("Pod")


def test_the_network_policy_admits_the_helm_test_pod(renders) -> None:
    rendered = renders["all"]
    (pod,) = rendered.find("Pod")
    (rule,) = rendered.one("NetworkPolicy")["spec"]["ingress"]
    selectors = [peer["podSelector"]["matchLabels"] for peer in rule["from"] if "podSelector" in peer]
    assert any(all(pod["metadata"]["labels"].get(k) == v for k, v in s.items()) for s in selectors)


@pytest.mark.parametrize("values,complaint", [
    ({"helmTest": {"keys": []}}, "minItems"),
    ({"zoneSpread": {"maxSkew": 0}}, "minimum"),
    ({"metrics": {"prometheusRule": {"runbookBaseUrl": "docs/runbooks.md"}}}, "pattern"),
])
def test_schema_rejects_bad_operator_values(values: dict, complaint: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=complaint):
        check_chart.render(values)
