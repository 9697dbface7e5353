"""Signed admin messages on the update topics: a tombstone purge (and any later admin-only message) carries an
HMAC-SHA256 of its bytes under ``updates.admin_key`` in the Kafka header ``hps-admin-hmac``, and a replica applies one
only if the signature is good. Without a key a replica applies none: any producer on the topic could otherwise
purge every tombstone (and so bring deleted rows back from an older replay).

The signature authenticates a message, not its freshness: an admin message already on the log can be produced
again by whoever can produce (as rows can); that repeats a purge, which only drops tombstones older than a version
the log can no longer deliver.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from prometheus_client import Counter
from pydantic import SecretStr

from hps_service.updates.message import DecodedUpdate, MalformedUpdateError

HEADER = "hps-admin-hmac"
#: Bound into every signature, so a key shared with another use cannot sign these messages by accident.
_CONTEXT = b"hps-admin-message-v1\0"
REFUSED = Counter("hps_update_admin_refused_total",
                  "Admin-only update messages (tombstone purges) refused and dead-lettered, by why", ["model", "reason"])


def sign(key: str, payload: bytes) -> bytes:
    """The ``hps-admin-hmac`` header value of ``payload`` under ``key`` (hex)."""
    return hmac.new(key.encode(), _CONTEXT + payload, hashlib.sha256).hexdigest().encode()


def is_admin(update: DecodedUpdate) -> bool:
    """Whether ``update`` is admin-only: a purge now; every admin-only message type is listed here."""
    return update.purge_tombstones_below > 0


class AdminMessages:
    """The consumer's check of admin-only messages under ``updates.admin_key``."""

    def __init__(self, key: SecretStr | None) -> None:
        self._key = key.get_secret_value() if key is not None else None

    def check(self, model: str, update: DecodedUpdate, payload: bytes,
              headers: Sequence[tuple[str, bytes | None]] | None) -> None:
        """MalformedUpdateError (the message is dead-lettered with the reason) unless ``update`` is an ordinary
        message or an admin one whose signature is good."""
        if not is_admin(update):
            return
        if self._key is None:
            self._refuse(model, "no_key", "admin message refused: updates.admin_key is not set on this replica")
        given = next((value for name, value in headers or () if name == HEADER), None)
        if given is None:
            self._refuse(model, "unsigned", f"admin message refused: no {HEADER} header")
        if not hmac.compare_digest(given, sign(self._key, payload)):  # type: ignore[arg-type]
            self._refuse(model, "bad_signature", "admin message refused: bad signature")

    @staticmethod
    def _refuse(model: str, reason: str, message: str) -> None:
        REFUSED.labels(model, reason).inc()
        raise MalformedUpdateError(message)
