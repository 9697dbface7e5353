"""The one error-to-status table: every domain error's gRPC code and HTTP status, as the servers answered them."""

from __future__ import annotations

import grpc
import pytest

from hps_client import errors
from hps_service.fleet.manifests import CorruptSnapshotError
from hps_service.fleet.sharding import WrongShardError
from hps_service.server.status import http_status_for, status_for

C = grpc.StatusCode


@pytest.mark.parametrize(("cls", "code", "http"), [
    (errors.InvalidArgumentError, C.INVALID_ARGUMENT, 400),
    (errors.NotFoundError, C.NOT_FOUND, 404),
    (errors.ResourceExhaustedError, C.RESOURCE_EXHAUSTED, 413),
    (errors.UnavailableError, C.UNAVAILABLE, 503),
    (errors.FailedPreconditionError, C.FAILED_PRECONDITION, 409),
    (WrongShardError, C.FAILED_PRECONDITION, 421),
    (errors.UnauthenticatedError, C.UNAUTHENTICATED, 401),
    (errors.PermissionDeniedError, C.PERMISSION_DENIED, 403),
    (errors.DeadlineExceededError, C.DEADLINE_EXCEEDED, 400),
    # the rest: FAILED_PRECONDITION and 400
    (errors.InternalError, C.FAILED_PRECONDITION, 400),
    (errors.CancelledError, C.FAILED_PRECONDITION, 400),
    (CorruptSnapshotError, C.FAILED_PRECONDITION, 400),
    (errors.HPSError, C.FAILED_PRECONDITION, 400),
])
def test_each_domain_error_answers_one_grpc_code_and_one_http_status(cls: type, code: grpc.StatusCode,
                                                                     http: int) -> None:
    err = cls("x", {0: 1}) if cls is WrongShardError else cls("x")
    assert status_for(err) == code and http_status_for(err) == http
