"""The chart's PrometheusRule, checked by Prometheus's own promtool: `promtool check rules` on the rendered rules,
and `promtool test rules` (tests/deploy/alert_rules_test.yaml) showing when each alert fires and when it must not:
update freshness, the lookup error ratio, consumer lag growing, the update stream stalled, a replica not ready, the L1 hit rate collapsing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.deploy.test_chart import check_chart
from tests.fixtures.prometheus import promtool

UNIT_TESTS = Path(__file__).with_name("alert_rules_test.yaml")


def _rules(tmp_path: Path, values: dict | None = None) -> Path:
    rendered = check_chart.render({"metrics": {"prometheusRule": {"enabled": True, **(values or {})}}})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rendered.one("PrometheusRule")["spec"], sort_keys=False))
    return path


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    checked = _promtool("check", "rules", str(_rules(tmp_path)))
    assert checked.returncode == 0 and "SUCCESS: 9 rules found" in checked.stdout, checked.stdout + checked.stderr
    extra = {"additionalRules": [{"alert": "Broken", "expr": "sum(rate(x[5m])"}]}
    broken = _promtool("check", "rules", str(_rules(tmp_path, extra)))
    assert broken.returncode != 0  # the check is not a formality


def test_alerts_fire_when_they_should_and_not_otherwise(tmp_path: Path) -> None:
    tests = tmp_path / "alert_rules_test.yaml"
    tests.write_text(UNIT_TESTS.read_text().replace("[RULES]", f"[{_rules(tmp_path)}]"))
    result = _promtool("test", "rules", str(tests))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    # the same tests against rules with a higher error threshold fail: the expectations bind the thresholds
    tests.write_text(UNIT_TESTS.read_text().replace("[RULES]", f"[{_rules(tmp_path, {'errorRatio': 0.1})}]"))
    assert _promtool("test", "rules", str(tests)).returncode != 0
