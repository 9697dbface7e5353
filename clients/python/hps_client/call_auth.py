"""A client's credential for a server with ``server.auth`` on: a read token, sent as ``authorization: Bearer
<token>`` metadata on every call (over TLS or not), or gRPC call credentials (which gRPC sends over TLS only)."""

from __future__ import annotations

import grpc

from hps_client.errors import InvalidArgumentError


def read_credentials(
    credentials: str | grpc.CallCredentials | None,
) -> tuple[tuple[tuple[str, str], ...], grpc.CallCredentials | None]:
    """The metadata a read token adds to every call, and the call credentials to pass with each call (None)."""
    if credentials is None:
        return (), None
    if isinstance(credentials, str):
        token = credentials.strip()
        if not token or any(c in token for c in "\r\n\0"):
            raise InvalidArgumentError("credentials: a token must be one non-empty line")
        return (("authorization", f"Bearer {token}"),), None
    if not isinstance(credentials, grpc.CallCredentials):
        raise InvalidArgumentError("credentials must be a token (str) or grpc.CallCredentials")
    return (), credentials
