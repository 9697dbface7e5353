"""Named arrays in files of a memory-backed directory, mapped by every process of a node.

The owner creates each array as a file (zero-filled and sparse: tmpfs backs a page only once it is written,
so a table's capacity is address space, not memory) and maps it shared and writable; workers map the same
files shared and writable (they write only their own counters and queues); colocated readers map them read-only.
A file's permission bits decide who may map it (:mod:`hps_service.shm.permissions`): the owner's user writes,
its colocated readers' group (``server.local.group``) reads, nobody else gets in.
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.errors import ResourceExhaustedError, UnavailableError
from hps_service.shm.permissions import PRIVATE, StoreAccess

#: ``alloc(name, shape, dtype) -> zeroed array``: where a data structure puts one of its arrays.
NamedAllocator = Callable[[str, tuple[int, ...], Any], np.ndarray]

#: Linux's flag that keeps a mapping out of the commit limit (pages are backed as they are written).
_MAP_NORESERVE = 0x4000


def anonymous(_name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Zeroed private memory that takes RAM only as pages are first written (one process's arrays)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = max(1, count * dtype.itemsize)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    except OSError as exc:
        raise ResourceExhaustedError(
            f"cannot reserve {nbytes / 2**30:.1f} GiB of address space for {_name} ({exc.strerror})") from None
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= 1 << 21:
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=dtype, count=count).reshape(shape)


class Region:
    """A directory of array files, each file and directory it creates made with ``access``'s modes and group."""

    def __init__(self, path: Path, *, writable: bool, access: StoreAccess = PRIVATE) -> None:
        self.path = Path(path)
        self.writable = writable
        self.access = access
        #: Bytes of every array file created here (sparse: memory is used only as pages are written).
        self.reserved = 0

    def create(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A new zero-filled array file ``name`` (relative, ``/`` makes subdirectories), mapped writable."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = max(1, count * dtype.itemsize)
        path = self.path / name
        self.access.make_dirs(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.access.file_mode)
        try:
            self.access.apply_fd(fd, path)  # whatever the umask
            try:
                os.ftruncate(fd, nbytes)
                region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _MAP_NORESERVE)
            except OSError as exc:
                os.unlink(path)
                raise ResourceExhaustedError(
                    f"cannot reserve {nbytes / 2**30:.2f} GiB of shared memory for {name} in {self.path} "
                    f"({exc.strerror}); make the memory-backed volume larger or lower the capacities") from None
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= 1 << 21:
            region.madvise(mmap.MADV_HUGEPAGE)  # honoured where shmem huge pages are enabled
        self.reserved += nbytes
        return np.frombuffer(region, dtype=dtype, count=count).reshape(shape)

    def room(self) -> int:
        """Bytes the filesystem under this region can still take."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def open(self, name: str, shape: tuple[int, ...], dtype: Any, *, writable: bool | None = None) -> np.ndarray:
        """Map the existing array file ``name``; read-only unless this region (or ``writable``) says otherwise."""
        writable = self.writable if writable is None else writable
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = max(1, count * dtype.itemsize)
        path = self.path / name
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise UnavailableError(f"the shared store has no {name} (the server restarted or dropped it)") from None
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise UnavailableError(f"{path} holds {size} bytes, expected {nbytes}: not the layout asked for")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        return np.frombuffer(region, dtype=dtype, count=count).reshape(shape)

    def remove(self, name: str) -> None:
        """Unlink an array file (processes that mapped it keep their mapping until they drop it)."""
        try:
            (self.path / name).unlink()
        except FileNotFoundError:
            pass

    def remove_tree(self, name: str) -> None:
        shutil.rmtree(self.path / name, ignore_errors=True)

    def allocator(self, prefix: str, record: dict[str, dict[str, Any]] | None = None) -> NamedAllocator:
        """An allocator creating ``<prefix>/<name>`` files; each allocation is noted in ``record`` (for the
        manifest readers attach by)."""

        def alloc(name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            full = f"{prefix}/{name}"
            arr = self.create(full, tuple(int(s) for s in shape), dtype)
            if record is not None:
                record[name] = array_spec(full, arr)
            return arr

        return alloc


def array_spec(file: str, arr: np.ndarray) -> dict[str, Any]:
    """How a reader maps ``arr`` again: its file, shape and dtype."""
    return {"file": file, "shape": list(arr.shape), "dtype": np.dtype(arr.dtype).str}


def open_spec(region: Region, spec: dict[str, Any], *, writable: bool | None = None) -> np.ndarray:
    """Map the array an :func:`array_spec` describes."""
    return region.open(spec["file"], tuple(spec["shape"]), np.dtype(spec["dtype"]), writable=writable)
