"""Who is calling: the admin token, a read token or a client certificate's identity, as ``server.auth`` says.

Protocol-free: the gRPC servicer and the REST gatekeeper hand over what the call carried (a bearer token, the
identities of a verified certificate) and get a :class:`Principal`, or an UnauthenticatedError /
PermissionDeniedError whose message names the reader or the model, never a token. Tokens are compared as SHA-256
digests (the time a lookup takes says nothing about the token), and tokens from files follow their file, so a rotated
Secret takes effect without a restart, and a file deleted or emptied revokes its token (fail closed).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hps_service.config import ServerConfig
from hps_service.config.secrets import WatchedSecret
from hps_service.config.security import ADMIN, ReaderConfig
from hps_service.errors import PermissionDeniedError, UnauthenticatedError

#: How often tokens from files are looked at for a change.
TOKEN_RECHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class Principal:
    """A caller the server knows: a reader (its models), the admin (every model), or a colocated reader."""

    name: str
    models: frozenset[str] | None = None  # None: every model

    def check_model(self, model: str) -> None:
        """PermissionDeniedError unless this caller may read ``model``."""
        if self.models is not None and model not in self.models:
            raise PermissionDeniedError(f"reader '{self.name}' may not read model '{model}'")

    def may_read(self, model: str) -> bool:
        return self.models is None or model in self.models


ADMIN_PRINCIPAL = Principal(ADMIN)
#: A caller on the server's Unix domain socket: a colocated reader, admitted by the socket's file permissions.
COLOCATED = Principal("colocated")


def principal_of(reader: ReaderConfig) -> Principal:
    return Principal(reader.name, None if "*" in reader.models else frozenset(reader.models))


class _Secret:
    """A token given in the config, or one that follows its file."""

    def __init__(self, value: str | None, path: Path | None, what: str) -> None:
        self._watched = WatchedSecret(path, what, TOKEN_RECHECK_S) if path is not None else None
        self._value = value

    def get(self) -> str | None:
        """The token; None when there is none (its file gone, empty or unreadable: fail closed)."""
        return self._watched.get() if self._watched is not None else self._value

    @property
    def from_file(self) -> bool:
        return self._watched is not None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (the scheme in any case); None for another scheme."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Authenticator:
    """Resolves callers for one server process, per ``server.auth`` and ``server.readers``."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.mode = cfg.auth
        token = cfg.admin_token.get_secret_value() if cfg.admin_token is not None else None
        self._admin = _Secret(token, cfg.admin_token_file, "server.admin_token_file")
        self._readers = [(principal_of(r), _Secret(r.token.get_secret_value() if r.token else None, r.token_file,
                                                   f"server.readers[{r.name}].token_file")) for r in cfg.readers]
        self._identities = {r.identity: principal_of(r) for r in cfg.readers if r.identity is not None}
        self._lock = threading.Lock()
        self._by_digest: dict[bytes, Principal] = {}
        self._tokens: tuple[str | None, ...] = ()
        self._checked = float("-inf")
        self._refresh(time.monotonic())

    @property
    def reads_need_credentials(self) -> bool:
        return self.mode != "none"

    # ---- admin -------------------------------------------------------------------------------------
    def admin(self, token: str | None) -> Principal:
        """The admin, if ``token`` is the admin token; else UnauthenticatedError (none given) or PermissionDeniedError
        (another token, or the admin API disabled)."""
        expected = self._admin.get()
        if expected is None:
            if self._admin.from_file:  # its file is gone or empty: revoked, not a fallback to anything else
                raise PermissionDeniedError("the admin API is disabled: server.admin_token_file holds no token now "
                                            "(see the server log)")
            raise PermissionDeniedError("the admin API is disabled: set server.admin_token or HPS_ADMIN_TOKEN")
        if token is None:
            raise UnauthenticatedError("missing 'Authorization: Bearer <admin token>'")
        if not hmac.compare_digest(_digest(token), _digest(expected)):
            raise PermissionDeniedError("invalid admin token")
        return ADMIN_PRINCIPAL

    # ---- readers -----------------------------------------------------------------------------------
    def reader_by_token(self, token: str | None) -> Principal:
        """The reader (or the admin) whose token ``token`` is; UnauthenticatedError otherwise."""
        if token is None:
            raise UnauthenticatedError("missing 'Authorization: Bearer <read token>' (server.auth is token)")
        now = time.monotonic()
        if now - self._checked >= TOKEN_RECHECK_S:
            self._refresh(now)
        principal = self._by_digest.get(_digest(token))
        if principal is None:
            raise UnauthenticatedError("invalid read token")
        return principal

    def reader_by_identities(self, identities: Iterable[str]) -> Principal:
        """The reader named by one of a verified client certificate's identities (subject CN, SANs)."""
        seen = list(identities)
        if not seen:
            raise UnauthenticatedError("no client certificate (server.auth is mtls)")
        for identity in seen:
            principal = self._identities.get(identity)
            if principal is not None:
                return principal
        raise PermissionDeniedError(f"client certificate {seen[0]!r} is not one of server.readers")

    def reader(self, token: str | None, identities: Iterable[str] = ()) -> Principal:
        """The caller of a read, per ``server.auth``; with auth none, an anonymous reader of every model."""
        if self.mode == "token":
            return self.reader_by_token(token)
        if self.mode == "mtls":
            return self.reader_by_identities(identities)
        return Principal("anonymous")

    def _refresh(self, now: float) -> None:
        """Rebuild the digest map when a token file changed (at most every TOKEN_RECHECK_S)."""
        with self._lock:
            self._checked = now
            admin = self._admin.get()
            tokens = (admin, *(secret.get() for _, secret in self._readers))
            if tokens == self._tokens:
                return
            by_digest = {_digest(t): p for (p, _), t in zip(self._readers, tokens[1:], strict=True) if t is not None}
            if admin is not None:
                by_digest.setdefault(_digest(admin), ADMIN_PRINCIPAL)
            self._by_digest, self._tokens = by_digest, tokens
