"""schemathesis against the served /openapi.json: valid and invalid generated requests (with the admin token) get
what the spec says each route answers (a documented status, content type and body: the typed 2xx models, problems
for errors), never a 5xx, and invalid ones are refused; bounded in examples per operation and in time."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig

from hps_service.serve.process import HPSServer
from tests.server.conftest import AUTH, ITEM_DIM, base_url, running, server_config

EXAMPLES_PER_OPERATION = 4
#: Each run's bound: about 10 s on 2 quiet cores, 75 s on 2 cores at a load of 20.
TIME_BUDGET_S = 240
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
#: An invalid request may be refused with any 4xx the API answers, 413 (a list over server.max_batch_keys) included.
CONFIG = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {
    "expected-statuses": [400, 401, 403, 404, 405, 409, 413, 421, 422]}}})


def _fuzz(url: str, operations: list[schemathesis.APIOperation], modes: list[GenerationMode],
          named: dict[str, object] | None = None) -> dict[str, list[int]]:
    """Each operation's generated requests in each mode, checked; ``named``: path parameters taken from it (the
    fixture's model, table, job, ...) instead of generated. The statuses answered, per operation."""
    statuses: dict[str, list[int]] = {op.label: [] for op in operations}
    for operation, mode in itertools.product(operations, modes):
        checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS
        strategy = operation.as_strategy(mode)
        if named is not None:
            strategy = strategy.map(lambda case: _named(case, named))

        check = _checker(url, strategy, checks, statuses[operation.label])
        try:
            check()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, operation.label  # nothing in the request can be made invalid
    return statuses


def _checker(url: str, strategy: Any, checks: list, answered: list[int]) -> Callable[[], None]:
    """A hypothesis test of ``strategy``'s cases, each called, checked and its status kept in ``answered``."""

    @given(case=strategy)
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        # the admin token in place of the generated one; none where the case was made invalid by leaving it out
        sent = AUTH if "Authorization" in (case.headers or {}) else {}
        answered.append(case.call_and_validate(base_url=url, headers=sent, checks=checks, timeout=90).status_code)

    return check


def _named(case: schemathesis.Case, named: dict[str, object]) -> schemathesis.Case:
    case.path_parameters = {name: named[name] for name in case.path_parameters or {}}
    return case


def test_every_route_answers_what_its_spec_says(server: HPSServer) -> None:
    url = base_url(server)
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=CONFIG)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 30
    started = time.monotonic()
    statuses = [s for answered in _fuzz(url, operations, list(GenerationMode)).values() for s in answered]
    assert max(statuses) < 500
    assert any(200 <= s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses)
    assert time.monotonic() - started < TIME_BUDGET_S


def test_routes_of_real_resources_answer_their_typed_bodies(tmp_path: Path) -> None:
    """The generated requests again, their paths naming what a server of their own holds (model, table, version,
    label, job, snapshot), so that each read answers its typed 2xx body; the deletes go last."""
    with running(server_config(tmp_path)) as server:
        _fuzz_named(base_url(server))


def _fuzz_named(url: str) -> None:
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
        put = http.put("/v1/models/demo/tables/item/embeddings",
                       json={"keys": [1, 2, 3], "vectors": [[0.5] * ITEM_DIM] * 3, "version": 1})
        assert put.status_code == 200, put.text
        http.post("/v1/models/demo/versions", json={"version": 1})
        assert http.put("/v1/models/demo/labels/canary", json={"version": 1, "allow_empty": True}).status_code == 200
        snapshot = http.post("/v1/models/demo/snapshots").json()["id"]
        job = http.post("/v1/models/demo/tables/user:convert", json={"storage": "fp16"}).json()["id"]
    named = {"model": "demo", "table": "item", "version": 1, "label": "canary", "snapshot_id": snapshot, "job_id": job}
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=CONFIG)
    operations = sorted((result.ok() for result in schema.get_all_operations()),  # the model's unload last
                        key=lambda op: (op.method == "delete", op.path == "/v1/models/{model}"))
    started = time.monotonic()
    statuses = _fuzz(url, operations, [GenerationMode.POSITIVE], named)
    reads = [op.label for op in operations if op.method == "get"]
    assert [label for label in reads if not any(200 <= s < 300 for s in statuses[label])] == []
    assert max(s for answered in statuses.values() for s in answered) < 500
    assert time.monotonic() - started < TIME_BUDGET_S


def test_refusals_of_a_caller_without_credentials_are_documented(tmp_path: Path) -> None:
    """With ``server.auth: token``, every route but the probes refuses a caller with no credential (401), and one
    whose reader may not read the model (403), as problems its spec lists."""
    (tmp_path / "ranker").write_text("ranker-read-token-0123")
    config = server_config(tmp_path, workers=0, auth="token", readers=[
        {"name": "ranker", "token_file": str(tmp_path / "ranker"), "models": ["other"]}])
    named = {"model": "demo", "table": "item", "version": 1, "label": "canary", "snapshot_id": "s", "job_id": "j"}
    with running(config) as server:
        url = base_url(server)
        schema = schemathesis.openapi.from_url(url + "/openapi.json", config=CONFIG, headers=AUTH)
        answered: dict[str, tuple[int, int]] = {}
        for operation in (result.ok() for result in schema.get_all_operations()):
            codes = []
            for headers in ({}, {"Authorization": "Bearer ranker-read-token-0123"}):
                case = operation.Case(path_parameters={p.name: named[p.name] for p in operation.path_parameters})
                codes.append(case.call_and_validate(base_url=url, headers=headers, checks=CHECKS, timeout=30)
                             .status_code)
            answered[operation.label] = (codes[0], codes[1])
    assert {label: codes for label, codes in answered.items() if codes[0] != 401} == {
        "GET /healthz": (200, 200), "GET /readyz": (200, 200)}
    by_model = {label for label, (_, reader) in answered.items() if reader == 403 and "{model}" in label}
    assert "GET /v1/models/{model}/tables/{table}/embeddings" in by_model and "GET /v1/models/{model}" in by_model


def _list_limits(operation: schemathesis.APIOperation) -> dict[str, int]:
    """The ``maxItems`` of each top-level list of an operation's JSON body (the rows routes' keys and vectors)."""
    body = operation.definition.raw.get("requestBody", {}).get("content", {}).get("application/json", {})
    properties = body.get("schema", {}).get("properties", {})
    return {name: p["maxItems"] for name, p in properties.items() if p.get("type") == "array" and "maxItems" in p}


def test_bodies_at_and_over_each_documented_list_limit(server: HPSServer) -> None:
    """Each body list the OpenAPI bounds (maxItems: server.max_batch_keys) taken at its bound, in its longest JSON,
    and refused one item past it with 413 naming the limit, never a 5xx."""
    url = base_url(server)
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    bounded = [(op, limits) for op in (r.ok() for r in schema.get_all_operations()) if (limits := _list_limits(op))]
    assert {op.label for op, _ in bounded} == {
        "POST /v1/models/{model}/tables/{table}/embeddings:lookup", "PUT /v1/models/{model}/tables/{table}/embeddings",
        "DELETE /v1/models/{model}/tables/{table}/embeddings"}
    dim = server.engine.table("demo", "item").dim
    for operation, limits in bounded:
        assert set(limits.values()) == {server.config.server.max_batch_keys}
        for extra, expected in ((0, 200), (1, 413)):
            body: dict = {}
            for name, limit in limits.items():
                n = limit + extra
                body[name] = [[-1.1754943508222875e-38] * dim] * n if name == "vectors" else \
                    list(range(-(2**63), -(2**63) + n))
            case = operation.Case(path_parameters={"model": "demo", "table": "item"}, body=body,
                                  media_type="application/json")
            response = case.call_and_validate(base_url=url, headers=AUTH, checks=[not_a_server_error], timeout=60)
            assert response.status_code == expected, (operation.label, extra, response.text[:200])
            if expected == 413:
                assert f"server.max_batch_keys={server.config.server.max_batch_keys}" in response.json()["error"]
