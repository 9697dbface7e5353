"""The config of who may read: ``server.auth`` (none | token | mtls) and the readers it admits, by read token or by
client-certificate identity, each with the models it may read. Admin routes always need the admin token."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, SecretStr, model_validator

from hps_service.config.base import NAME_PATTERN, Section
from hps_service.config.secrets import load_secret_files

if TYPE_CHECKING:
    from hps_service.config import ServerConfig

AuthMode = Literal["none", "token", "mtls"]
#: Where ``/metrics``, ``/docs`` and the stats routes are served: the REST port (``http``), the probe port.
InternalListener = Literal["http", "probe"]
#: The name the admin token goes by in the audit log; no reader may take it.
ADMIN = "admin"
#: Every model (in ``readers[].models``).
ALL_MODELS = "*"
MIN_TOKEN_CHARS = 16


class ReaderConfig(Section):
    """One caller allowed to read: by a bearer token (``server.auth: token``) or by the identity in its client
    certificate (``server.auth: mtls``). Its name, never its token, is what the audit log and errors show."""

    name: str = Field(pattern=NAME_PATTERN, description="the reader's name in the audit log and errors (never its token)")
    token: SecretStr | None = Field(None, description="auth token: the bearer token (prefer token_file)")
    token_file: Path | None = Field(None, description="auth token: a file holding the token (a mounted Secret; "
                                    "re-read when it changes)")
    identity: str | None = Field(
        None, min_length=1, max_length=1024, description="auth mtls: the client certificate's subject common name "
        "or one of its subject alternative names (DNS name, URI such as spiffe://..., e-mail)")
    models: list[str] = Field(min_length=1, description="models this reader may read; '*': every model")

    @model_validator(mode="after")
    def _token_file(self) -> ReaderConfig:
        load_secret_files(self, f"server.readers[{self.name}]", "token")
        if self.token is not None and len(self.token.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(f"server.readers[{self.name}]: a read token needs at least {MIN_TOKEN_CHARS} characters")
        return self

    def may_read(self, model: str) -> bool:
        return ALL_MODELS in self.models or model in self.models


def check_auth(server: ServerConfig) -> None:
    """Refuse an ``auth`` setting the readers cannot satisfy (a mistake would lock everyone out or let anyone in)."""
    names = [r.name for r in server.readers]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"server.readers: duplicate name(s) {', '.join(dupes)}")
    if ADMIN in names:
        raise ValueError(f"server.readers: the name '{ADMIN}' is the admin token's")
    if server.auth == "none":
        if server.readers:
            raise ValueError("server.readers is set but server.auth is none: set server.auth to token or mtls")
        return
    if not server.readers:
        raise ValueError(f"server.auth {server.auth} needs at least one entry in server.readers")
    if server.auth == "token":
        missing = [r.name for r in server.readers if r.token is None]
        if missing:
            raise ValueError(f"server.auth token: reader(s) {', '.join(missing)} have no token or token_file")
        tokens = [r.token.get_secret_value() for r in server.readers if r.token is not None]
        if len(set(tokens)) != len(tokens):
            raise ValueError("server.readers: two readers share a token (it must name one reader)")
        return
    if server.tls is None or server.tls.client_ca_file is None:
        raise ValueError("server.auth mtls needs server.tls with client_ca_file (clients must present certificates)")
    missing = [r.name for r in server.readers if r.identity is None]
    if missing:
        raise ValueError(f"server.auth mtls: reader(s) {', '.join(missing)} have no identity")
