"""The client certificate behind a REST request: uvicorn's HTTP/1.1 protocol, with the identities of the certificate
the TLS handshake verified (subject CN, subject alternative names) put into each request's ``state``, which ASGI
gives no other way to see (``server.auth: mtls`` checks them per model, as gRPC does from its auth context)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

#: The ``state`` key of the identities (the gatekeeper reads it).
PEER_IDENTITIES = "hps_peer_identities"


def certificate_identities(cert: dict[str, Any] | None) -> list[str]:
    """The subject common name(s), then every subject alternative name of ``ssl.getpeercert()``'s answer."""
    if not cert:
        return []
    names = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    return names + [value for _kind, value in cert.get("subjectAltName", ())]


class PeerIdentityProtocol(H11Protocol):
    """H11Protocol whose requests carry ``state[PEER_IDENTITIES]`` of the connection's client certificate."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn types BaseTransport; it passes a Transport
        super().connection_made(transport)
        identities = certificate_identities(transport.get_extra_info("peercert"))
        if identities:  # this connection's own copy: app_state is shared by every connection of the server
            self.app_state = {**self.app_state, PEER_IDENTITIES: identities}
