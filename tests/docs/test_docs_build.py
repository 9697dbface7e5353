"""The user documentation (docs/, mkdocs.yml): the site builds with ``mkdocs build --strict`` (every nav entry, link and
anchor resolves) and needs nothing from outside at build or read time; the configuration reference is the one
generated from the config model; the REST reference lists exactly the app's routes; every alert's runbook anchor is
a heading of the built runbooks page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field

from hps_service.admin.jobs import JobRunner
from hps_service.config import HPSConfig, load_config
from hps_service.engine import LookupEngine
from hps_service.fleet.registry_log import ModelRegistrations
from hps_service.server.grpc_service import ServingGate
from hps_service.server.metrics import ServerMetrics
from hps_service.server.rest import AdminContext, create_app
from tests.helpers import load_script

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
#: ``| `METHOD /path` |`` at the start of a row of the REST reference's route table.
ROUTE_ROW = re.compile(r"^\| `(GET|POST|PUT|DELETE|PATCH) (/[^`]*)` \|", re.MULTILINE)
#: ``| `operationId` | METHOD `/path` | 200 `Model` | 401 403 |``: a row of the REST reference's typed answers.
ANSWER_ROW = re.compile(r"^\| `(\w+)` \| (GET|POST|PUT|DELETE) `([^`]+)` \| (\d{3}) ([^|]+) \| ([\d ]+) \|$",
                        re.MULTILINE)


gen_config_reference = load_script("gen_config_reference", DOCS / "gen_config_reference.py")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_site_builds_strict_with_every_page_in_its_nav(site: Path) -> None:
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def pages(entries: list) -> list[str]:
        out = []
        for entry in entries:
            (value,) = entry.values()
            out += pages(value) if isinstance(value, list) else [value]
        return out

    listed = set(pages(nav))
    written = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert written == listed, f"pages not in the nav: {written - listed}; nav entries with no page: {listed - written}"
    for page in listed:
        html = site / page.removesuffix(".md").removesuffix("index") / "index.html"
        assert html.is_file(), html


def test_the_site_needs_nothing_from_outside(site: Path) -> None:
    """No web font, script, stylesheet or image is loaded from another host (an offline reader gets the whole page)."""
    external = re.compile(r"""<(?:link|script|img)\b[^>]*\b(?:href|src)=["'](?:https?:)?//""", re.IGNORECASE)
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert not external.findall(text), (html, external.findall(text)[:3])
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, html


def test_every_alert_links_to_a_heading_of_the_runbooks_page(site: Path) -> None:
    """The chart's runbook_url anchors (the alert's name, lower-cased) are the ids MkDocs gives the headings."""
    rules = (REPO / "deploy" / "helm" / "hps" / "templates" / "prometheusrule.yaml").read_text()
    alerts = set(re.findall(r"^\s*- alert: (\w+)", rules, re.MULTILINE))
    assert len(alerts) >= 6, alerts
    html = (site / "runbooks" / "index.html").read_text()
    ids = set(re.findall(r'<h2 id="([^"]+)"', html))
    assert {a.lower() for a in alerts} <= ids, {a.lower() for a in alerts} - ids


def test_the_configuration_reference_is_generated_and_current() -> None:
    assert gen_config_reference.main([]) == 0, "run: python docs/gen_config_reference.py --write"
    page = gen_config_reference.PAGE.read_text()
    for row in ("| `server.grpc_port` | int (≥ 0, ≤ 65535) | `8500` |", "| `server.tls.cert_file` | path | *required* |",
                "| `models[].tables[].dim` | int (≥ 1, ≤ 16384) | *required* |",
                '| `cache.policy` | "lru" \\| "lfu" | `"lru"` |'):
        assert row in page, row
    keys = re.findall(r"^\| `([a-z0-9_\[\].]+)` \|", page, re.MULTILINE)
    assert {k for k in keys if keys.count(k) > 1} == {"volatile.type"}  # each backend's table names its type
    assert set(keys) == _schema_leaves(HPSConfig.model_json_schema())


def _schema_leaves(schema: dict, node: dict | None = None, path: str = "") -> set[str]:
    """Every leaf key of the config as pydantic's own JSON schema has it (another walk of the model than the
    generator's): objects of properties are sections, arrays of them sections with ``[]``, anything else a key."""
    node = schema if node is None else node
    if "$ref" in node:
        return _schema_leaves(schema, schema["$defs"][node["$ref"].rsplit("/", 1)[-1]], path)
    if "oneOf" in node:  # a section that is one of several models (volatile): the keys of each
        return set().union(*(_schema_leaves(schema, option, path) for option in node["oneOf"]))
    options = [o for o in node.get("anyOf", []) if o.get("type") != "null"]
    if len(options) == 1 and ("$ref" in options[0] or "properties" in options[0]):
        return _schema_leaves(schema, options[0], path)
    if node.get("type") == "array" and "$ref" in node.get("items", {}):
        return _schema_leaves(schema, node["items"], path + "[]")
    if "properties" in node:
        return set().union(*(_schema_leaves(schema, sub, f"{path}.{key}" if path else key)
                             for key, sub in node["properties"].items()))
    return {path}


def test_a_key_without_a_description_is_refused() -> None:
    class Inner(BaseModel):
        """A nested section."""

        told: int = Field(1, description="described")
        untold: str = "x"

    class Outer(BaseModel):
        """The root."""

        inner: Inner = Field(default_factory=Inner)
        items: list[Inner] = Field(default_factory=list)

    keys = [k for s in gen_config_reference.sections(Outer) for k in s.keys]
    assert [k.path for k in keys if not k.description] == ["inner.untold", "items[].untold"]
    assert gen_config_reference.undocumented() == []


def _rest_spec() -> dict:
    cfg = load_config(persistent={"type": "disabled"}, volatile={"type": "disabled"})
    engine = LookupEngine(None, None)
    app = create_app(AdminContext(engine, cfg, ServerMetrics(engine), ServingGate(), JobRunner(), None,
                                  lambda: ([], {}), ModelRegistrations(engine, (), lambda: None)))
    return app.openapi()


def test_the_rest_reference_lists_exactly_the_apps_routes() -> None:
    routes = [(method.upper(), path) for path, ops in _rest_spec()["paths"].items() for method in ops]
    documented = ROUTE_ROW.findall((DOCS / "reference" / "rest.md").read_text())
    assert sorted(documented) == sorted(routes)


def test_the_rest_reference_lists_each_operations_typed_answer_and_errors() -> None:
    """The table of typed answers: each route's operation id, 2xx status and body model, and error statuses, as the
    spec says them."""
    spec = []
    for path, ops in _rest_spec()["paths"].items():
        for method, op in ops.items():
            ok = next(code for code in op["responses"] if code.startswith("2"))
            schema = next(iter(op["responses"][ok].get("content", {}).values()), {}).get("schema", {})
            refs = [s["$ref"] for s in schema.get("anyOf", [schema]) if "$ref" in s]
            spec.append((op["operationId"], method.upper(), path, ok, [r.rsplit("/", 1)[1] for r in refs],
                         [code for code in op["responses"] if not code.startswith("2")]))
    documented = [(op, method, path, ok, re.findall(r"`(\w+)`", answer), errors.split())
                  for op, method, path, ok, answer, errors in ANSWER_ROW.findall(
                      (DOCS / "reference" / "rest.md").read_text())]
    assert sorted(documented) == sorted(spec)
