"""The one table of what each domain error answers: its gRPC status code and its HTTP status (the RFC 9457
problem's ``status``; its ``title`` is that status's phrase), read by the gRPC servicer and by the REST API."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from hps_client.attempts import PUSHBACK
from hps_service.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    HPSError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from hps_service.fleet.sharding import WrongShardError

__all__ = ["ERROR_STATUS", "NO_RETRY", "OTHER_ERROR", "ErrorStatus", "http_status_for", "status_for", "status_of"]

#: gRPC's server pushback (gRFC A6) telling a client's retry policy not to retry: sent with the RESOURCE_EXHAUSTED
#: of a request over a limit, so that only an overloaded server's (gRPC's own, at max_concurrent_requests) is retried.
NO_RETRY = ((PUSHBACK, "-1"),)


@dataclass(frozen=True)
class ErrorStatus:
    """What one kind of domain error answers on each protocol."""

    grpc: grpc.StatusCode
    http: int


#: Each domain error class and its answer, checked in order: the first class the error is an instance of wins, so a
#: subclass comes before its base.
ERROR_STATUS: tuple[tuple[type[HPSError], ErrorStatus], ...] = (
    # a key of another shard is a request for another server (HTTP Misdirected Request)
    (WrongShardError, ErrorStatus(grpc.StatusCode.FAILED_PRECONDITION, 421)),
    (FailedPreconditionError, ErrorStatus(grpc.StatusCode.FAILED_PRECONDITION, 409)),
    (UnauthenticatedError, ErrorStatus(grpc.StatusCode.UNAUTHENTICATED, 401)),
    (PermissionDeniedError, ErrorStatus(grpc.StatusCode.PERMISSION_DENIED, 403)),
    (InvalidArgumentError, ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400)),
    (NotFoundError, ErrorStatus(grpc.StatusCode.NOT_FOUND, 404)),
    (ResourceExhaustedError, ErrorStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, 413)),
    (UnavailableError, ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503)),
    (DeadlineExceededError, ErrorStatus(grpc.StatusCode.DEADLINE_EXCEEDED, 400)),
)
#: The answer of any other domain error (InternalError, CorruptSnapshotError, a bare HPSError, ...).
OTHER_ERROR = ErrorStatus(grpc.StatusCode.FAILED_PRECONDITION, 400)


def status_of(err: HPSError) -> ErrorStatus:
    """The answers of a domain error (:data:`ERROR_STATUS`, else :data:`OTHER_ERROR`)."""
    return next((answer for cls, answer in ERROR_STATUS if isinstance(err, cls)), OTHER_ERROR)


def status_for(err: HPSError) -> grpc.StatusCode:
    """The gRPC status code of a domain error."""
    return status_of(err).grpc


def http_status_for(err: HPSError) -> int:
    """The HTTP status of a domain error."""
    return status_of(err).http
