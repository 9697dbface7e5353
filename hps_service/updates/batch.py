"""What one polled batch of update messages holds for one table, and the engine change it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from confluent_kafka import Message

from hps_service.engine import TableChange, ttl
from hps_service.updates.message import DecodedUpdate


@dataclass
class TableBatch:
    """Rows and tombstones of one table gathered from the messages of one polled batch."""

    keys: list[np.ndarray] = field(default_factory=list)
    vectors: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    delete_keys: list[np.ndarray] = field(default_factory=list)
    delete_versions: list[np.ndarray] = field(default_factory=list)
    #: Per row, its message's write time (``produced_at_ns`` in seconds), for tables with ``ttl_s``.
    written_s: list[np.ndarray] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)

    def add(self, upd: DecodedUpdate, msg: Message) -> None:
        """Add one decoded message (kept, so a refused change can be checked message by message)."""
        if upd.keys.shape[0]:
            self.keys.append(upd.keys)
            self.vectors.append(upd.vectors)
            self.versions.append(upd.versions)
            self.written_s.append(np.full(upd.keys.shape[0], ttl.message_time_s(upd.produced_at_ns), np.int64))
        if upd.delete_keys.shape[0]:
            self.delete_keys.append(upd.delete_keys)
            self.delete_versions.append(upd.delete_versions)
        self.messages.append(msg)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


def table_change(model: str, table: str, batches: list[TableBatch], dim: int) -> TableChange:
    """The rows and deletes of ``batches`` (one table of width ``dim``) as one engine change."""
    vectors = [v for b in batches for v in b.vectors]
    return TableChange(
        model=model,
        table=table,
        keys=_concat([k for b in batches for k in b.keys], np.int64),
        vectors=np.concatenate(vectors) if vectors else np.empty((0, dim), dtype=np.float32),
        versions=_concat([v for b in batches for v in b.versions], np.int64),
        delete_keys=_concat([k for b in batches for k in b.delete_keys], np.int64),
        delete_versions=_concat([v for b in batches for v in b.delete_versions], np.int64),
        written_s=_concat([w for b in batches for w in b.written_s], np.int64),
    )
