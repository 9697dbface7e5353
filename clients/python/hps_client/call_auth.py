"""What every call of a client carries to a server with ``server.auth`` on: its credential, a read token sent as
``authorization: Bearer <token>`` metadata (over TLS or not) or gRPC call credentials (sent over TLS only), and the
metadata a caller adds to one call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from hps_client.errors import InvalidArgumentError

#: gRPC metadata: (key, value) pairs, keys lower case.
Metadata = Sequence[tuple[str, str | bytes]]


class CallAuth:
    """The keyword arguments of each stub call: ``metadata`` (the token's, then the call's own) and ``credentials``."""

    def __init__(self, credentials: str | grpc.CallCredentials | None) -> None:
        """``credentials``: a read token (str), gRPC call credentials, or None (a server with auth none)."""
        self._metadata: tuple[tuple[str, str | bytes], ...] = ()
        self._call_credentials: grpc.CallCredentials | None = None
        if isinstance(credentials, str):
            token = credentials.strip()
            if not token or any(c in token for c in "\r\n\0"):
                raise InvalidArgumentError("credentials: a token must be one non-empty line")
            self._metadata = (("authorization", f"Bearer {token}"),)
        elif credentials is not None:
            if not isinstance(credentials, grpc.CallCredentials):
                raise InvalidArgumentError("credentials must be a token (str) or grpc.CallCredentials")
            self._call_credentials = credentials

    def __call__(self, metadata: Metadata | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self._metadata or metadata:
            kwargs["metadata"] = (*self._metadata, *(metadata or ()))
        if self._call_credentials is not None:
            kwargs["credentials"] = self._call_credentials
        return kwargs
