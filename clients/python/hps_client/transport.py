"""The transport seam (httpx's, for lookups): a client builds a :mod:`call <hps_client.calls>` and hands it to its
transport's one method, ``handle``. gRPC (:mod:`hps_client.grpc_transport`), asyncio gRPC
(:mod:`hps_client.aio_transport`) and the colocated shared-memory reader (registered by hps-service) are transports;
the target picks one (``local:///PATH``: the colocated reader), never the class a caller asked for."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, TypeVar

from hps_client.calls import Call
from hps_client.errors import InvalidArgumentError

R = TypeVar("R")

#: Targets ``local:///PATH`` read a colocated server's shared store at PATH.
LOCAL_SCHEME = "local://"
#: Where ``local://`` targets read when the target names no path.
DEFAULT_STORE = "/dev/shm/hps"
#: The entry point group where a package registers the transport of ``local://`` targets (hps-service does), so
#: that this distribution imports no server code.
TRANSPORTS_GROUP = "hps_client.transports"


class Transport(Protocol):
    """Answers a client's calls, synchronously."""

    def handle(self, call: Call[R]) -> R:
        """The answer of ``call`` (an :class:`~hps_client.errors.HPSError` naming why there is none)."""
        ...

    def close(self) -> None:
        """Release connections and mappings; the transport answers nothing after."""
        ...


class AsyncTransport(Protocol):
    """Answers a client's calls in an event loop."""

    async def handle(self, call: Call[R]) -> R:
        """The answer of ``call`` (an :class:`~hps_client.errors.HPSError` naming why there is none)."""
        ...

    async def close(self) -> None:
        """Release connections and mappings; the transport answers nothing after."""
        ...


def is_local(targets: object) -> bool:
    """Whether ``targets`` names a colocated store (``local:///PATH``)."""
    return isinstance(targets, str) and targets.startswith(LOCAL_SCHEME)


def local_transport(target: str, interceptors: Sequence[Any] = (), retries: int = 3,
                    backoff_s: float = 0.05) -> Transport:
    """The transport an installed package registers for ``local://`` targets, over the store the target names;
    InvalidArgumentError when none is installed."""
    found = entry_points(group=TRANSPORTS_GROUP, name="local")
    if not found:
        raise InvalidArgumentError(f"{target}: colocated reads need the hps-service package "
                                   f"(pip install hps-service), not only hps-client")
    transport: Transport = next(iter(found)).load()(target[len(LOCAL_SCHEME):] or DEFAULT_STORE,
                                                    interceptors=interceptors, retries=retries, backoff_s=backoff_s)
    return transport
