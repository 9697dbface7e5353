"""The caller of a gRPC call: a bearer token from the call's metadata or the identities of the client certificate
gRPC verified, resolved by the :class:`~hps_service.server.auth.Authenticator`. A call on the server's Unix domain
socket comes from a colocated reader, whom the socket's file permissions admit (it carries no TLS)."""

from __future__ import annotations

import grpc

from hps_service.server.auth import COLOCATED, Authenticator, Principal, bearer_token

#: Properties of gRPC's auth context that name the peer's certificate (its subject CN, then each SAN).
_IDENTITY_PROPERTIES = ("x509_common_name", "x509_subject_alternative_name")


def metadata_token(context: grpc.ServicerContext) -> str | None:
    """The bearer token of the call's ``authorization`` metadata, if any."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return bearer_token(value if isinstance(value, str) else None)
    return None


def certificate_identities(context: grpc.ServicerContext) -> list[str]:
    """The subject CN and subject alternative names of the client certificate gRPC verified (none without one)."""
    auth = context.auth_context()
    return [v.decode(errors="replace") for prop in _IDENTITY_PROPERTIES for v in _values(auth.get(prop))]


def _values(prop: object) -> list[bytes]:
    """The values of an auth context property: grpc gives a sequence of them (typeshed's stubs type one bytes)."""
    return [v for v in prop if isinstance(v, bytes)] if isinstance(prop, list | tuple) else []


def grpc_principal(auth: Authenticator, context: grpc.ServicerContext) -> Principal:
    """Who made the call; UnauthenticatedError or PermissionDeniedError when ``server.auth`` does not admit it."""
    if context.peer().startswith("unix:"):
        return COLOCATED
    if auth.mode == "token":
        return auth.reader_by_token(metadata_token(context))
    return auth.reader_by_identities(certificate_identities(context))
