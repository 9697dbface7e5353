"""Write the chart's README (deploy/helm/hps/README.md: what ``helm show readme`` prints and chart indexes show): an
introduction, and a table of every value generated from values.schema.json (key, type, description) and values.yaml
(default), so the table cannot drift from what ``helm install`` accepts.

Run ``python deploy/chart_readme.py --write`` after changing either file; without ``--write`` it exits 1 when the
README is stale or a value has no description (``make test`` runs that check).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART_DIR = Path(__file__).resolve().parent / "helm" / "hps"
README = CHART_DIR / "README.md"
#: A default longer than this is shown as "see values.yaml".
MAX_DEFAULT = 60

INTRO = """\
# hps: the Helm chart of hps-service

A StatefulSet of hps-service lookup servers (gRPC lookups, REST admin API, Prometheus metrics): each pod keeps hot
rows in its L1 cache, warm rows in an in-process hash map (or a shared Redis Cluster), and every row in RocksDB on its
own volume; optionally it follows a Kafka update log and restores from snapshots in S3. The default values alone
install a self-contained service.

```sh
helm install hps deploy/helm/hps                            # defaults: embedded tiers, updates off
helm install hps deploy/helm/hps -f deploy/examples/values-gpu-redis-kafka.yaml
helm test hps                                               # a pod looks keys up through the Service
```

- `config` is the server's own configuration file (`hps_service.config.HPSConfig`); values.schema.json checks it
  against the server's model, so a typo fails `helm install`, not the pod.
- Alerts (`metrics.prometheusRule`) carry a `runbook_url`: one runbook per alert in docs/runbooks.md.
- Pods spread softly over zones (`zoneSpread`) and over nodes (`affinity`) by default.
- `helm test` runs `hps lookup` of `helmTest.keys` through the release's Service (every shard's name when sharded).

## Values

Generated from values.schema.json and values.yaml by `python deploy/chart_readme.py --write`.

| Key | Type | Default | Description |
| --- | --- | --- | --- |
"""


def _type(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "object" if "$ref" in schema else "any")
    return " | ".join(kind) if isinstance(kind, list) else kind


def _default(values: Any, path: list[str]) -> str:
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return ""
        values = values[key]
    text = json.dumps(values, separators=(", ", ": "))
    return "see values.yaml" if len(text) > MAX_DEFAULT else f"`{text}`"


def rows(schema: dict[str, Any], values: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """(key, type, default, description) of every value: the leaves of the schema's objects, in the schema's order.
    ``config`` is one row (its keys are the server's configuration reference)."""
    out = []
    for key, sub in schema.get("properties", {}).items():
        path = (*prefix, key)
        if sub.get("type") == "object" and "properties" in sub and path != ("config",):
            out += rows(sub, values, path)
            continue
        out.append((".".join(path), _type(sub), _default(values, list(path)), sub.get("description", "")))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(schema: dict[str, Any], values: dict[str, Any]) -> str:
    table = "".join(f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(text)} |\n"
                    for key, kind, default, text in rows(schema, values))
    return INTRO + table


def undocumented(schema: dict[str, Any]) -> list[str]:
    """Values the schema gives no description (each needs one: the table is their documentation)."""
    return [key for key, _, _, text in rows(schema, {}) if not text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the chart's README.md")
    args = parser.parse_args(argv)
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    missing = undocumented(schema)
    if missing:
        print(f"values without a description in values.schema.json: {', '.join(missing)}", file=sys.stderr)
        return 1
    expected = render(schema, values)
    if args.write:
        README.write_text(expected)
        print(f"wrote {README}")
        return 0
    if not README.is_file() or README.read_text() != expected:
        print(f"{README} is stale: run `python deploy/chart_readme.py --write`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
