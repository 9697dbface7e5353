"""The errors of hps-service, shared by the client and the server (``hps_service.errors`` re-exports these).

A server-side ``NotFoundError`` and the one a client raises for a NOT_FOUND answer are the same class, so
``except hps_client.NotFoundError`` catches both.
"""

from __future__ import annotations


class HPSError(Exception):
    """Base of every error a caller can cause or see; the message names the problem."""


class InvalidArgumentError(HPSError):
    """The request is malformed (gRPC INVALID_ARGUMENT, HTTP 400/422)."""


class NotFoundError(HPSError):
    """A model, table or resource that does not exist (gRPC NOT_FOUND, HTTP 404)."""


class ResourceExhaustedError(HPSError):
    """A configured limit was exceeded (gRPC RESOURCE_EXHAUSTED, HTTP 413/429)."""


class UnavailableError(HPSError):
    """The service cannot answer right now: starting, draining, or a required tier is down."""


class FailedPreconditionError(HPSError):
    """The request is valid but this server is not the one to answer it, e.g. keys of another shard (gRPC
    FAILED_PRECONDITION, HTTP 409/421)."""


class LookupError_(HPSError):
    """A call failed with a status the client does not map to a narrower error (DEADLINE_EXCEEDED, INTERNAL...)."""


class UnauthenticatedError(HPSError):
    """The call carries no credential, or one the server does not know (gRPC UNAUTHENTICATED, HTTP 401)."""


class PermissionDeniedError(HPSError):
    """The caller is known but may not do this, e.g. read a model it is not allowed (gRPC PERMISSION_DENIED,
    HTTP 403)."""
