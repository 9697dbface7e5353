"""schemathesis against the served /openapi.json: valid and invalid generated requests (with the admin token) never
get a 5xx."""

from __future__ import annotations

import itertools

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from hps_service.serve.process import HPSServer
from tests.server.conftest import AUTH, base_url

EXAMPLES_PER_OPERATION = 4


def test_no_server_errors(server: HPSServer) -> None:
    url = base_url(server)
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    statuses: list[int] = []
    for operation, mode in itertools.product(operations, GenerationMode):

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            response = case.call_and_validate(base_url=url, headers=AUTH, checks=[not_a_server_error], timeout=30)
            statuses.append(response.status_code)

        try:
            check()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, operation.label  # nothing in the request can be made invalid
    assert max(statuses) < 500
    assert any(200 <= s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses)


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
