"""The REST API's gatekeeper: an ASGI middleware that decides, from a request's line and headers alone, whether it
is served on this port, who is calling and whether they may, and how many body bytes it may send; only then does the
request reach FastAPI, whose reads of the body are counted against that bound.

So an unauthenticated or oversized body costs the server its headers: it is answered 401/403/413 at once, and the
body is never read (the connection is closed behind the answer). Admin requests, refused or served, each leave an
entry in the audit log.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hps_service.errors import PermissionDeniedError, UnauthenticatedError
from hps_service.server.audit import AUDIT_STATE, AuditEntry, AuditLog
from hps_service.server.auth import Authenticator, Principal, bearer_token
from hps_service.server.problems import CLOSE, send_problem
from hps_service.server.rest_access import BodyLimits, RoutePolicy, policy_of
from hps_service.server.status import http_status_for
from hps_service.server.tls_peer import PEER_IDENTITIES

#: The ASGI scope key naming the listener a request came in on (set by :class:`Listener`); absent: the REST port.
LISTENER = "hps.listener"
#: The key of a request's ``state`` holding the caller the gatekeeper resolved (beside its audit entry, under
#: ``audit.AUDIT_STATE``, and the identities of its client certificate, under ``tls_peer.PEER_IDENTITIES``).
PRINCIPAL = "hps_principal"


class Listener:
    """The app as served on one extra port (the probe port): its requests are marked with the port's name."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.name = name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, LISTENER: self.name}
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers") or ()
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


class Gatekeeper:
    """Per route (:mod:`hps_service.server.rest_access`): served here? caller allowed? body within bound?"""

    def __init__(self, app: ASGIApp, *, router: Router, auth: Authenticator, limits: BodyLimits, audit: AuditLog,
                 internal_on: Collection[str]) -> None:
        self.app = app
        self.router = router
        self.auth = auth
        self.limits = limits
        self.audit = audit
        self.internal_on = frozenset(internal_on)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        matched = self._match(scope)
        if matched is None:  # no such path, or another method: the app answers 404 / 405
            await self.app(scope, receive, send)
            return
        name, params = matched
        policy = policy_of(name, scope["method"])
        listener = scope.get(LISTENER, "http")
        if not self._served_on(policy, listener):
            await send_problem(send, 404, f"{scope['path']} is not served on this port")
            return
        entry = (AuditEntry(who="anonymous", action=name, method=scope["method"], path=scope["path"],
                            model=params.get("model"), table=params.get("table"))
                 if policy.access == "admin" else None)
        status = [0]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._serve(scope, receive, sending, policy, params, listener, entry)
        finally:
            if entry is not None:
                entry.status = status[0] or 500
                self.audit.record(entry)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, policy: RoutePolicy,
                     params: dict[str, str], listener: str, entry: AuditEntry | None) -> None:
        token = bearer_token(_header(scope, b"authorization"))
        try:
            principal = self._caller(policy, scope, params, listener, token)
        except UnauthenticatedError as err:
            if entry is not None:
                entry.who = "anonymous" if token is None else "unknown credential"
            await send_problem(send, http_status_for(err), str(err), {"WWW-Authenticate": "Bearer"})
            return
        except PermissionDeniedError as err:
            if entry is not None:
                entry.who = "invalid admin token" if token is not None else "anonymous"
            await send_problem(send, http_status_for(err), str(err))
            return
        if entry is not None and principal is not None:
            entry.who = principal.name
        limit = self.limits.bound(policy.body, params)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await send_problem(send, 413, self._too_large(int(declared), limit, policy))
            return
        state = scope.setdefault("state", {})
        state[PRINCIPAL], state[AUDIT_STATE] = principal, entry
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body (no Content-Length) past its bound: refused as it arrives
                    raise HTTPException(413, self._too_large(seen, limit, policy), headers=CLOSE)
            return message

        await self.app(scope, bounded, send)

    def _caller(self, policy: RoutePolicy, scope: Scope, params: dict[str, str], listener: str,
                token: str | None) -> Principal | None:
        """The caller the route needs (None where it needs none); the auth errors when it is not admitted."""
        if policy.access == "public":
            return None
        if policy.access == "admin":
            return self.auth.admin(token)
        if (policy.access == "internal" and listener != "http") or not self.auth.reads_need_credentials:
            return None
        identities = scope.get("state", {}).get(PEER_IDENTITIES, ())
        principal = self.auth.reader(token, identities)
        if "model" in params:  # a read, or an internal route of one model (/v1/cache/{model}/{table})
            principal.check_model(params["model"])
        return principal

    def _served_on(self, policy: RoutePolicy, listener: str) -> bool:
        if policy.access == "public":
            return True
        if policy.access == "internal":
            return listener in self.internal_on
        return listener == "http"

    def _match(self, scope: Scope) -> tuple[str, dict[str, str]] | None:
        for route in self.router.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                return getattr(route, "name", ""), dict(child.get("path_params", {}))
        return None

    def _too_large(self, size: int, limit: int, policy: RoutePolicy) -> str:
        return (f"request body of {size} bytes exceeds the {limit} bytes allowed for {self.limits.describe(policy.body)}"
                f" (server.max_batch_keys={self.limits.max_batch_keys}, server.max_body_bytes="
                f"{self.limits.max_body_bytes})")


def caller_of(state: Any) -> Principal | None:
    """The caller the gatekeeper resolved for a request (its ``request.state``); None where none was needed."""
    return getattr(state, PRINCIPAL, None)
