"""Domain errors raised beneath the server layer; the servers translate them to protocol codes.

They are the client's classes (``hps_client.errors``), so a server-side NotFoundError and the one a client raises
for a NOT_FOUND answer are one class family.
"""

from __future__ import annotations

from hps_client.errors import (
    FailedPreconditionError,
    HPSError,
    InvalidArgumentError,
    LookupError_,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = ["FailedPreconditionError", "HPSError", "InvalidArgumentError", "LookupError_", "NotFoundError",
           "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError", "UnavailableError"]
