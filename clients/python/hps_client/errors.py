"""The errors of hps-service, shared by the client and the server (``hps_service.errors`` re-exports these).

A server-side ``NotFoundError`` and the one a client raises for a NOT_FOUND answer are the same class, so
``except hps_client.NotFoundError`` catches both. Every error carries the gRPC status it stands for (``.code``, a
``grpc.StatusCode``) and the server's message (``.details``); ``str(err)`` is ``"CODE: details"`` for a failed call.
"""

from __future__ import annotations

import warnings
from typing import Any

import grpc


class HPSError(Exception):
    """Base of every error a caller can cause or see; the message names the problem."""

    #: The gRPC status of this kind of error (a server answers it; a client raises this class for it).
    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "", *, code: grpc.StatusCode | None = None, details: str | None = None) -> None:
        super().__init__(message)
        #: The gRPC status code of the failed call (or the one the server answers for this error).
        self.code: grpc.StatusCode = code if code is not None else self.default_code
        #: The server's message, without the code.
        self.details: str = message if details is None else details


class InvalidArgumentError(HPSError):
    """The request is malformed (gRPC INVALID_ARGUMENT, HTTP 400/422)."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(HPSError):
    """A model, table or resource that does not exist (gRPC NOT_FOUND, HTTP 404)."""

    default_code = grpc.StatusCode.NOT_FOUND


class ResourceExhaustedError(HPSError):
    """A configured limit was exceeded (gRPC RESOURCE_EXHAUSTED, HTTP 413/429)."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StreamLimitError(ResourceExhaustedError):
    """The server refused a stream: it holds ``server.max_streams`` streams, or this caller
    ``server.max_streams_per_caller`` (close a stream, or make unary calls)."""


class UnavailableError(HPSError):
    """The service cannot answer right now: starting, draining, or a required tier is down."""

    default_code = grpc.StatusCode.UNAVAILABLE


class FailedPreconditionError(HPSError):
    """The request is valid but this server is not the one to answer it, e.g. keys of another shard (gRPC
    FAILED_PRECONDITION, HTTP 409/421)."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class _CallFailed(HPSError):
    """What ``LookupError_`` caught before the narrower classes below existed (kept so old handlers still work)."""


class DeadlineExceededError(_CallFailed, TimeoutError):
    """The call's deadline passed before its answer came (gRPC DEADLINE_EXCEEDED); also a ``TimeoutError``."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class InternalError(_CallFailed):
    """The server failed on its own account (gRPC INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED), or a shard's
    answer did not match what was asked: not the caller's mistake, worth reporting."""

    default_code = grpc.StatusCode.INTERNAL


class CancelledError(_CallFailed):
    """The call was cancelled before it finished (gRPC CANCELLED)."""

    default_code = grpc.StatusCode.CANCELLED


class UnauthenticatedError(_CallFailed):
    """The server needs credentials the call did not carry, or they are invalid (gRPC UNAUTHENTICATED, HTTP 401)."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(_CallFailed):
    """The caller's identity may not do this (gRPC PERMISSION_DENIED, HTTP 403)."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


#: The client error class of each status code (what a failed call raises).
ERROR_OF_CODE: dict[grpc.StatusCode, type[HPSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


def error_for(code: grpc.StatusCode, details: str) -> HPSError:
    """The client error of a call that ended with ``code`` (InternalError for codes no narrower class covers)."""
    cls = ERROR_OF_CODE.get(code, InternalError)
    return cls(f"{code.name}: {details}", code=code, details=details)


def __getattr__(name: str) -> Any:
    """``LookupError_``: the old catch-all, a deprecated alias (one release) of the base of DeadlineExceededError,
    InternalError, CancelledError, UnauthenticatedError and PermissionDeniedError."""
    if name == "LookupError_":
        warnings.warn("hps_client.LookupError_ is deprecated: catch DeadlineExceededError (a TimeoutError), "
                      "InternalError, CancelledError, or HPSError", DeprecationWarning, stacklevel=2)
        return _CallFailed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
