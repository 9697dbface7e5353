"""A model registered or unloaded on a node's owner is answered for once every gRPC worker serves the change: each
worker writes the manifest generation it serves into its status row, and the owner waits for the ready ones."""

from __future__ import annotations

import time

from hps_service.errors import UnavailableError
from hps_service.node.store.node_store import NodeStore

#: How long a registration waits for the workers (a worker reopens its RocksDB secondary for new tables).
WORKERS_SERVE_TIMEOUT_S = 30.0


def wait_workers_serve(store: NodeStore, workers: int, what: str, timeout_s: float = WORKERS_SERVE_TIMEOUT_S) -> None:
    """Return once every ready worker serves the manifest published last; UnavailableError naming ``what`` and the
    workers still behind after ``timeout_s`` (workers starting load the newest manifest before they serve)."""
    deadline = time.monotonic() + timeout_s
    while behind := store.workers_behind(workers):
        if time.monotonic() > deadline:
            raise UnavailableError(f"{what} is done on the server, but gRPC worker(s) {behind} did not serve it "
                                   f"within {timeout_s:g} s")
        time.sleep(0.002)
