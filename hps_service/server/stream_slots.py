"""The open streams of a serving process, counted in all (``server.max_streams``) and per caller
(``server.max_streams_per_caller``), so that one reader cannot hold every slot. A caller is the reader its credential
names with ``server.auth`` on, else the address it calls from (every connection of one host is one caller)."""

from __future__ import annotations

import threading

import grpc

from hps_service.errors import HPSError
from hps_service.server.auth import Authenticator
from hps_service.server.grpc_auth import grpc_principal


def peer_host(peer: str) -> str:
    """The host part of gRPC's ``context.peer()`` (``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7``; ``ipv6:[::1]:5``
    -> ``ipv6:[::1]``); a Unix domain socket's peers are one caller, ``unix``."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{address.rpartition(':')[0] or address}"
    return kind


def stream_caller(context: grpc.ServicerContext, auth: Authenticator | None) -> str:
    """Who holds a stream: ``reader <name>`` when ``server.auth`` admits its credential, else its address (an
    anonymous caller, or one whose credential the stream's method itself refuses)."""
    if auth is not None:
        try:
            return f"reader {grpc_principal(auth, context).name}"
        except HPSError:
            pass
    return peer_host(context.peer())


class StreamSlots:
    """:meth:`take` admits a stream while fewer than ``limit`` are open and its caller holds fewer than
    ``per_caller``; a refusal names what is counted (``what``) and the keys that set the two bounds (``keys``: the
    limit's, then a template of the per-caller bound's)."""

    def __init__(self, limit: int, per_caller: int, what: str = "streams",
                 keys: tuple[str, str] = ("server.max_streams", "server.max_streams_per_caller={per_caller}")) -> None:
        self.limit = limit
        self.per_caller = per_caller
        self.what = what
        self._limit_says = f"{keys[0]}={limit}"
        self._per_caller_says = keys[1].format(per_caller=per_caller)
        self._lock = threading.Lock()
        self._open = 0
        self._by_caller: dict[str, int] = {}

    def take(self, caller: str) -> str | None:
        """Admit a stream of ``caller`` (None), or why it is refused."""
        with self._lock:
            held = self._by_caller.get(caller, 0)
            if self._open >= self.limit:
                return (f"{self.limit} {self.what} are open on this serving process, the most {self._limit_says} "
                        "allows; close one, or send unary calls")
            if held >= self.per_caller:
                return (f"{held} {self.what} are open for {caller}, the most {self._per_caller_says} allows; close "
                        "one, or send unary calls")
            self._open += 1
            self._by_caller[caller] = held + 1
            return None

    def give_back(self, caller: str) -> None:
        """A stream of ``caller`` admitted by :meth:`take` ended."""
        with self._lock:
            self._open -= 1
            left = self._by_caller[caller] - 1
            if left:
                self._by_caller[caller] = left
            else:
                del self._by_caller[caller]

    def open_streams(self) -> int:
        """Streams open now."""
        with self._lock:
            return self._open
