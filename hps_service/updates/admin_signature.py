"""Signed admin messages: a tombstone purge on an update topic, and every change on the registration log
(``fleet.registry_log``), carries an HMAC-SHA256 of its bytes under ``updates.admin_key`` in the Kafka header
``hps-admin-hmac``, and a replica applies one only if the signature is good. Without a key a replica applies none:
any producer on the topic could otherwise purge every tombstone (and so bring deleted rows back from an older replay),
or unload every model of every replica.

Each use signs under its own context (what the MAC is bound to besides the bytes), so that a signature made for one
use is no signature for another: a purge's is none on the registration log, nor one fleet's registration on another
fleet's log (two topic prefixes sharing a key).

The signature authenticates a message, not its freshness: an admin message already on the log can be produced
again by whoever can produce (as rows can); that repeats a purge, which only drops tombstones older than a version
the log can no longer deliver, or a registration change (see docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from prometheus_client import Counter
from pydantic import SecretStr

from hps_service.errors import FailedPreconditionError
from hps_service.updates.consumed import ProduceHeaders
from hps_service.updates.message import DecodedUpdate, MalformedUpdateError

HEADER = "hps-admin-hmac"
#: Bound into every signature of an update topic's admin messages, so a key shared with another use cannot sign
#: these messages by accident.
UPDATE_CONTEXT = b"hps-admin-message-v1\0"
REFUSED = Counter("hps_update_admin_refused_total",
                  "Admin-only update messages (tombstone purges) refused and dead-lettered, by why", ["model", "reason"])
#: Why a message that must be signed is refused, by reason (the refusal metrics' label).
REASONS = {
    "no_key": "updates.admin_key is not set on this replica",
    "unsigned": f"no {HEADER} header",
    "bad_signature": "bad signature",
}


def registry_context(topic: str) -> bytes:
    """What the signatures of the registration log ``topic`` are bound to: their use and the topic itself (a Kafka
    topic name holds no NUL)."""
    return b"hps-registry-message-v1\0" + topic.encode() + b"\0"


def sign(key: str, payload: bytes, context: bytes = UPDATE_CONTEXT) -> bytes:
    """The ``hps-admin-hmac`` header value of ``payload`` under ``key`` and ``context`` (hex)."""
    return hmac.new(key.encode(), context + payload, hashlib.sha256).hexdigest().encode()


class Signature:
    """Signs and checks messages of one use (``context``) under ``updates.admin_key`` (None: signs and accepts
    none)."""

    def __init__(self, key: SecretStr | None, context: bytes = UPDATE_CONTEXT) -> None:
        self._key = key.get_secret_value() if key is not None else None
        self._context = context

    @property
    def can_sign(self) -> bool:
        return self._key is not None

    def headers(self, payload: bytes) -> ProduceHeaders:
        """The Kafka headers that sign ``payload``; FailedPreconditionError without a key."""
        if self._key is None:
            raise FailedPreconditionError("signing needs updates.admin_key (the same on every replica)")
        return [(HEADER, sign(self._key, payload, self._context))]

    def refusal(self, payload: bytes, headers: Sequence[tuple[str, bytes | None]] | None) -> str | None:
        """Why a message with ``payload`` and ``headers`` is refused (a key of :data:`REASONS`), or None when its
        signature is good."""
        if self._key is None:
            return "no_key"
        given = next((value for name, value in headers or () if name == HEADER), None)
        if given is None:
            return "unsigned"
        if not hmac.compare_digest(given, sign(self._key, payload, self._context)):
            return "bad_signature"
        return None


def is_admin(update: DecodedUpdate) -> bool:
    """Whether ``update`` is admin-only: a purge now; every admin-only message type is listed here."""
    return update.purge_tombstones_below > 0


class AdminMessages:
    """The consumer's check of admin-only messages under ``updates.admin_key``."""

    def __init__(self, key: SecretStr | None) -> None:
        self._signature = Signature(key)

    def check(self, model: str, update: DecodedUpdate, payload: bytes,
              headers: Sequence[tuple[str, bytes | None]] | None) -> None:
        """MalformedUpdateError (the message is dead-lettered with the reason) unless ``update`` is an ordinary
        message or an admin one whose signature is good."""
        if not is_admin(update):
            return
        reason = self._signature.refusal(payload, headers)
        if reason is not None:
            REFUSED.labels(model, reason).inc()
            raise MalformedUpdateError(f"admin message refused: {REASONS[reason]}")
