"""schemathesis against the served /openapi.json: valid and invalid generated requests (with the admin token) never
get a 5xx."""

from __future__ import annotations

import itertools

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from hps_service.server.app import HPSServer
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
