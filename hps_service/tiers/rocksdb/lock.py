"""Whether another process holds a RocksDB directory: RocksDB takes a POSIX lock on its ``LOCK`` file for as long as
it is open, so a tool about to open it (``hps import``) can tell a running server first, and say so, instead of
failing on RocksDB's own ``IO error: lock ... Resource temporarily unavailable``."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


def held_elsewhere(path: Path) -> bool:
    """Whether another process has the RocksDB at ``path`` open (its ``LOCK`` file is locked); False when there is no
    store there yet. Must not be called by a process that has it open itself (POSIX locks are per process)."""
    lock = Path(path) / "LOCK"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    except PermissionError:
        return False  # not ours to open: RocksDB's own open says so
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return True
        raise
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
