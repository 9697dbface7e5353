"""Whether a serving process accepts lookups: closed while it starts and while it drains, with the reason why.

The owner, each gRPC worker and the REST probes read one gate; the node's subclasses publish it to the shared store.
"""

from __future__ import annotations

import threading

from hps_service.errors import UnavailableError

#: Why a server that received SIGTERM is not ready, and why it refuses lookups once its lame-duck moment is over.
DRAINING = "the server is draining"


class ServingGate:
    """Whether lookups are accepted: closed while starting and while draining. ``draining`` is set the moment a
    server begins to drain, while it still answers (readiness already says it is going)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.reason = "the server is starting"
        self.draining = False

    def begin_draining(self) -> None:
        """Say the server is going (readiness) while lookups are still answered, until :meth:`close`."""
        self.draining = True

    def open(self) -> None:
        self._open.set()

    def close(self, reason: str) -> None:
        self.reason = reason
        self._open.clear()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def check(self) -> None:
        if not self._open.is_set():
            raise UnavailableError(self.reason)
