"""Domain errors raised beneath the server layer; the servers translate them to protocol codes.

They are the client's classes (``hps_client.errors``), so a server-side NotFoundError and the one a client raises
for a NOT_FOUND answer are one class family.
"""

from __future__ import annotations

from typing import Any

from hps_client import errors as _errors
from hps_client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    HPSError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = ["DeadlineExceededError", "FailedPreconditionError", "HPSError", "InternalError", "InvalidArgumentError",
           "NotFoundError", "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError",
           "UnavailableError"]


def __getattr__(name: str) -> Any:
    """``LookupError_``, the client's deprecated catch-all."""
    return _errors.__getattr__(name)
