"""``LocalClient``: the client over a colocated server's shared store (:mod:`hps_service.node.colocated`).

    client = LocalClient("/dev/shm/hps")            # the same as HPSClient("local:///dev/shm/hps")
    rows = client.lookup("demo", "item", keys)      # L1 and hash-map hits at memory speed, the rest over the socket
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hps_client.channel import Metadata
from hps_client.client import HPSClient
from hps_service.node.colocated import ColocatedTransport


class LocalClient(HPSClient):
    """:class:`hps_client.HPSClient` over the colocated transport of the store at ``path`` (the server's
    ``server.local.path``); ``socket_path``: its socket, when the store (which names it) cannot be mapped."""

    def __init__(self, path: str | Path = "/dev/shm/hps", timeout: float | None = 5.0, *,
                 socket_path: str | Path | None = None, retries: int = 3, backoff_s: float = 0.05,
                 metadata: Metadata | None = None, interceptors: Sequence[Any] | None = None) -> None:
        self.colocated = ColocatedTransport(path, socket_path=socket_path, retries=retries, backoff_s=backoff_s,
                                            interceptors=tuple(interceptors or ()))
        super().__init__(f"local://{path}", timeout, retries, backoff_s, metadata=metadata, transport=self.colocated)

    @property
    def path(self) -> Path:
        return self.colocated.path

    @property
    def socket_path(self) -> Path:
        return self.colocated.socket_path

    @property
    def mapped(self) -> bool:
        """Whether a live store is mapped now (else every lookup goes over the socket)."""
        return self.colocated.mapped

    @property
    def remaps(self) -> int:
        """Times a new generation of the store was mapped (the server restarted)."""
        return self.colocated.remaps
