"""The owner's gRPC Unix domain socket (``server.uds_path``; colocated ``LocalClient`` misses), created with its final
mode and group: it is bound in a private directory (0700), given the mode and group there, and renamed into place, so
no one but the server's user can ever connect to it with looser bits (gRPC binds with the process umask, and a chmod
after the bind left a window in which the socket listened at 0755). gRPC unlinks the path it bound on stop, which
the rename moved: the server removes the socket itself (:meth:`UnixSocket.remove`)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

from hps_service.errors import UnavailableError
from hps_service.shm.permissions import StoreAccess


@dataclass(frozen=True)
class UnixSocket:
    """A socket this server put at ``path`` (``inode``: which one, so that a newer server's is never removed)."""

    path: Path
    inode: int

    def remove(self) -> None:
        """Unlink the socket once the server stopped, unless another server's has replaced it since."""
        try:
            if self.path.stat().st_ino == self.inode:
                self.path.unlink()
        except FileNotFoundError:
            pass


def bind_unix_socket(server: grpc.Server, path: Path, access: StoreAccess) -> UnixSocket:
    """Serve ``server`` on the Unix domain socket ``path`` too, which appears there with ``access.socket_mode`` and
    its group (a socket left at ``path`` by an earlier server is replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_socket():
        raise UnavailableError(f"cannot serve gRPC on {path}: a file that is not a socket is there")
    private = Path(tempfile.mkdtemp(prefix=".grpc-", dir=path.parent))  # 0700: the server's user alone
    try:
        bound = private / "s"
        if server.add_insecure_port(f"unix:{bound}") == 0:
            raise UnavailableError(f"cannot bind gRPC to the Unix domain socket {path}")
        access.apply(bound, access.socket_mode)
        inode = bound.stat().st_ino
        os.replace(bound, path)
    finally:
        for leftover in private.iterdir():
            leftover.unlink()
        private.rmdir()
    return UnixSocket(path, inode)
