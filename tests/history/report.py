"""What a history run reports: operation counts, the edges it went through, and every violation with its key's full
history (each write and read of the key up to a little after the violating read) and the update topic's messages of
the key; plus what RocksDB holds at the end, for the tiers-agree check."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, TopicPartition

from tests.history.model import DEFAULT, History, Violation, decode_rows, key_history


def report(history: History, violations: list[Violation], t0: float, edges: dict[str, int] | None = None,
           limit: int = 10) -> str:
    """Operation counts, the edges reached, and the first ``limit`` violations, each with its key's full history."""
    counts = history.counts()
    lines = [f"history: {counts['operations']} operations ("
             + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "operations")
             + f"); {len(violations)} violations"]
    if edges:
        lines.append("edges: " + ", ".join(f"{k}: {v}" for k, v in edges.items()))
    lines.append("keys answered by " + ", ".join(f"{via}: {_by_source(history, via)}"
                                                 for via in sorted({r.via for r in history.reads})))
    for v in violations[:limit]:
        when = "" if v.at is None else f" (lookup at {v.at - t0:.3f})"
        lines.append(f"VIOLATION key {v.key}: {v.rule}: {v.detail}{when}")
        lines.append(key_history(history, v.key, t0, limit=None, at=v.at))
    return "\n".join(lines)


def topic_log(broker: str, model: str, keys: np.ndarray, timeout: float = 30.0) -> str:
    """Every message of the update topic that touches ``keys``, in partition and offset order, for a violation
    report: what the broker holds is the other half of the story (was the acknowledged write ever there?)."""
    from hps_service.updates.message import decode_update, topic_name

    topic = topic_name(model)
    consumer = Consumer({"bootstrap.servers": broker, "group.id": f"{model}-dump", "enable.auto.commit": False})
    lines: list[tuple[int, int, str]] = []
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics[topic]
        parts = sorted(meta.partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1] for p in parts}
        consumer.assign([TopicPartition(topic, p, 0) for p in parts if ends[p] > 0])
        left = {p for p in parts if ends[p] > 0}
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 1.0):
                if msg.error() is not None:
                    continue
                if msg.offset() >= ends[msg.partition()] - 1:
                    left.discard(msg.partition())
                upd = decode_update(msg.value())
                for kind, ks, vs in (("put", upd.keys, upd.versions), ("delete", upd.delete_keys,
                                                                       upd.delete_versions)):
                    for i in np.flatnonzero(np.isin(ks, keys)):
                        lines.append((msg.partition(), msg.offset(),
                                      f"  [{msg.partition()}]@{msg.offset()} key {int(ks[i])} {kind} v{int(vs[i])}"))
                if upd.purge_tombstones_below:
                    lines.append((msg.partition(), msg.offset(), f"  [{msg.partition()}]@{msg.offset()} purge "
                                                                 f"below v{upd.purge_tombstones_below}"))
    finally:
        consumer.close()
    return "\n".join(text for _, _, text in sorted(lines))


def stored_versions(db: Path, table_id: str, keys: np.ndarray) -> np.ndarray:
    """What RocksDB holds for every key (the server stopped): the row's version, or DEFAULT."""
    from hps_service.tiers.rocksdb.tier import RocksDBTier

    store = RocksDBTier(db, read_only=True)
    try:
        got = store.get(table_id, keys)
    finally:
        store.close()
    shown = decode_rows(keys, got.vectors, np.where(got.found, 3, 4))
    return np.where(got.found, shown, DEFAULT)


def _by_source(history: History, via: str) -> str:
    """How the reads of ``via`` were answered: keys per level (L1, L2, L3, default)."""
    sources = [r.sources for r in history.reads if r.via == via]
    counts = np.bincount(np.concatenate(sources).astype(np.int64), minlength=5) if sources else np.zeros(5, int)
    return "/".join(str(int(c)) for c in counts[1:5]) + " (L1/L2/L3/default)"
