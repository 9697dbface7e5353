"""The keys of every publish, written before the publish is sent, so a resume knows what the lost steps published.

A run that dies after its checkpoint may have published rows of later steps; the resumed run starts from the
checkpoint's rows, so exactly those keys must be published again (or deleted where the checkpoint holds no row).
Records live in ``DIR/journal/seg-*.bin`` segments: per record, step, table name and the upserted and deleted
keys, fsynced before the rows go out. A checkpoint at step ``s`` starts a new segment and drops the older ones
(every record in them is of a step <= s, which the checkpoint covers).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

_HEADER = struct.Struct("<qHqq")  # step, table name length, upserts, deletes


class PublishJournal:
    """Append-only records of (step, table, upserted keys, deleted keys); thread-safe."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory / "journal"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self._open_segment()

    def _open_segment(self):  # noqa: ANN202 - a binary file object
        return open(self.directory / f"seg-{time.time_ns():020d}.bin", "ab")

    def append(self, step: int, changes: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Record ``{table: (upserted keys, deleted keys)}`` of a publish at ``step``, durably."""
        parts = []
        for table, (keys, deletes) in changes.items():
            name = table.encode()
            parts += [_HEADER.pack(step, len(name), keys.size, deletes.size), name,
                      np.ascontiguousarray(keys, dtype="<i8").tobytes(),
                      np.ascontiguousarray(deletes, dtype="<i8").tobytes()]
        with self._lock:
            self._file.write(b"".join(parts))
            self._file.flush()
            os.fsync(self._file.fileno())

    def rotate(self) -> None:
        """After a checkpoint: start a new segment and drop the ones written before it."""
        with self._lock:
            self._file.close()
            old = sorted(self.directory.glob("seg-*.bin"))
            self._file = self._open_segment()
            for path in old:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    @staticmethod
    def keys_after(directory: Path, step: int) -> dict[str, np.ndarray]:
        """Every key any run published (upsert or delete) at a step after ``step``, per table."""
        found: dict[str, list[np.ndarray]] = {}
        for path in sorted((directory / "journal").glob("seg-*.bin")):
            data = path.read_bytes()
            pos = 0
            while pos + _HEADER.size <= len(data):
                rec_step, name_len, n_up, n_del = _HEADER.unpack_from(data, pos)
                end = pos + _HEADER.size + name_len + 8 * (n_up + n_del)
                if end > len(data):
                    break  # a record cut short by a crash: its publish was never sent
                name = data[pos + _HEADER.size: pos + _HEADER.size + name_len].decode()
                if rec_step > step:
                    keys = np.frombuffer(data, dtype="<i8", count=n_up + n_del, offset=pos + _HEADER.size + name_len)
                    found.setdefault(name, []).append(keys.astype(np.int64))
                pos = end
        return {name: np.unique(np.concatenate(parts)) for name, parts in found.items()}
