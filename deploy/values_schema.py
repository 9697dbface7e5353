"""Keep the chart's values.schema.json in step with the server's config model.

The chart's ``config`` value is the server's YAML config, so its schema is generated from
``hps_service.config.HPSConfig``: a typo or an out-of-range value fails ``helm install`` instead of the pod.
Run ``python deploy/values_schema.py --write`` after changing hps_service/config.py; without ``--write``
it exits 1 when the file is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hps_service.config import HPSConfig

SCHEMA_PATH = Path(__file__).resolve().parent / "helm" / "hps" / "values.schema.json"


def config_defs() -> dict[str, Any]:
    """The JSON-schema ``$defs`` for HPSConfig and its sections, HPSConfig itself under its own name."""
    generated = HPSConfig.model_json_schema()
    defs = dict(generated.pop("$defs", {}))
    defs["HPSConfig"] = generated
    return dict(sorted(defs.items()))


def expected_schema(current: dict[str, Any]) -> dict[str, Any]:
    """``current`` with its ``$defs`` replaced by those generated from the config model."""
    updated = dict(current)
    updated["$defs"] = config_defs()
    updated["properties"] = {**current["properties"], "config": {**current["properties"].get("config", {}),
                                                                     "$ref": "#/$defs/HPSConfig"}}
    return updated


def _structure(schema: Any) -> Any:
    """The schema without annotations (titles, descriptions, defaults), which do not change validation."""
    if isinstance(schema, dict):
        return {k: _structure(v) for k, v in schema.items() if k not in ("title", "description", "default")}
    if isinstance(schema, list):
        return [_structure(v) for v in schema]
    return schema


def is_current(current: dict[str, Any]) -> bool:
    """Whether ``current`` validates the config exactly as the config model does now."""
    return _structure(current) == _structure(expected_schema(current))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite values.schema.json")
    args = parser.parse_args(argv)
    current = json.loads(SCHEMA_PATH.read_text())
    expected = expected_schema(current)
    if args.write:
        SCHEMA_PATH.write_text(json.dumps(expected, indent=2) + "\n")
        print(f"wrote {SCHEMA_PATH}")
        return 0
    if not is_current(current):
        print(f"{SCHEMA_PATH} is stale: run `python deploy/values_schema.py --write`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
