"""Who may open the node's shared store: the server's user alone (files 0600, directories 0700), or, with
``server.local.group``, also that group (0640/0750, the files given to the group): the colocated readers of the pod,
which may map the rows but never write them. Every directory the store creates gets these bits, the intermediate
ones too, whatever the umask."""

from __future__ import annotations

import grp
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hps_service.config import LocalStoreConfig
from hps_service.errors import InvalidArgumentError


def resolve_group(group: str | int | None) -> int | None:
    """The gid of ``server.local.group`` (a gid, or a group name known to this host); None when unset."""
    if group is None:
        return None
    if isinstance(group, int) or group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidArgumentError(f"server.local.group {group!r} is not a group on this host (give its gid)") from None


@dataclass(frozen=True)
class StoreAccess:
    """The modes and the group the store's files, directories and socket are made with."""

    gid: int | None = None

    @property
    def file_mode(self) -> int:
        return 0o640 if self.gid is not None else 0o600

    @property
    def dir_mode(self) -> int:
        return 0o750 if self.gid is not None else 0o700

    @property
    def socket_mode(self) -> int:
        """The gRPC socket colocated readers send their misses to: they connect as they map the store."""
        return 0o660 if self.gid is not None else 0o600

    def apply(self, path: Path, mode: int) -> None:
        """Give ``path`` ``mode`` and the group."""
        os.chmod(path, mode)
        gid = self.gid
        if gid is not None:
            self._chown(lambda: os.chown(path, -1, gid), path)

    def apply_fd(self, fd: int, name: Path | str) -> None:
        """Give the open file ``fd`` (``name``, for a message) the file mode and the group."""
        os.fchmod(fd, self.file_mode)
        gid = self.gid
        if gid is not None:
            self._chown(lambda: os.fchown(fd, -1, gid), name)

    def make_dirs(self, path: Path) -> None:
        """``path`` and each of its missing parents, created with the directory mode and the group."""
        missing = []
        p = Path(path)
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=self.dir_mode)
            except FileExistsError:
                pass  # made by another process meanwhile: its bits are set below all the same
            self.apply(d, self.dir_mode)

    def _chown(self, change: Callable[[], None], name: Path | str) -> None:
        try:
            change()
        except PermissionError:
            raise InvalidArgumentError(f"cannot give {name} to server.local.group {self.gid}: the server's user is "
                                       f"not a member of that group") from None


#: The store of a server without colocated readers (and of one whose readers run as its own user).
PRIVATE = StoreAccess()


def local_access(local: LocalStoreConfig) -> StoreAccess:
    """The access ``server.local`` asks for: its group's, when colocated reads are on and a group is named."""
    return StoreAccess(resolve_group(local.group)) if local.enabled else PRIVATE
