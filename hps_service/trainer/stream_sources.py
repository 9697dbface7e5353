"""Sources without an end: a Kafka topic of click events, or a directory whose new files are trained as they land.

``kafka://host:port[,host:port]/topic``: each message is either Criteo-format lines (tab-separated, one sample a
line, several lines a message allowed) or one Parquet file holding a batch (recognised by its ``PAR1`` magic). A
sample's time is the Parquet ``timestamp`` column, else the message's timestamp. Every partition is read with
``assign()`` from the checkpoint's position (exact to the row inside a message), else the consumer group's
committed offsets, else the start; the group's offsets are committed only after a checkpoint holding them is
complete, so the checkpoint, not the group, is where a resume starts. A message that is not a click log is counted
and skipped, never retried forever.

``dir:///path`` (``--follow``): files are trained in name order; a file is picked up once its name appears, so a
writer writes ``.name`` or ``name.tmp`` and renames it when complete. The position is (file name, rows of it
trained); a file that appears with a name before the current one is never read (name order is the contract).

Both yield ``(None, position, 0)`` while there is no data, and a batch shorter than asked once its first sample
has waited ``max_wait_s``; they return when ``stop`` is set, leaving untrained samples for the next run.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from hps_service.trainer.criteo import DENSE_FIELDS, CriteoFiles, FileFormat, encode, tsv_options
from hps_service.trainer.data import Batch
from hps_service.trainer.sources import BatchItem, SourceBase

log = logging.getLogger(__name__)
_PARQUET_MAGIC = b"PAR1"


@dataclass
class Chunk:
    """Encoded samples with how the position moves as its rows are trained: ``after(j)`` after its first j."""

    batch: Batch
    after: Callable[[int], dict[str, Any]]
    used: int = 0


def assemble(chunks: Iterator[Chunk | None], batch_size: int, max_wait_s: float,
             position: dict[str, Any]) -> Iterator[BatchItem]:
    """Batches of ``batch_size`` samples from ``chunks`` (None: nothing new yet), each with the position after it."""
    pending: list[Chunk] = []
    held = 0
    first_t = 0.0

    def take(n: int) -> Batch | None:
        """The next ``n`` samples; the position moves through every chunk in order (empty ones too)."""
        nonlocal held
        parts = []
        while pending and (n or not len(pending[0].batch)):
            chunk = pending[0]
            k = min(n, len(chunk.batch) - chunk.used)
            if k:
                parts.append(chunk.batch.rows(slice(chunk.used, chunk.used + k)))
            chunk.used += k
            n -= k
            held -= k
            position.update(chunk.after(chunk.used))
            if chunk.used == len(chunk.batch):
                pending.pop(0)
        return Batch.concat(parts) if parts else None

    for chunk in chunks:
        if chunk is not None:
            if not held:
                first_t = time.monotonic()
            pending.append(chunk)  # an empty one (a skipped message, a file's end) moves the position in turn
            held += len(chunk.batch)
            if not held:
                take(0)
        while held >= batch_size:
            yield take(batch_size), dict(position), batch_size
            first_t = time.monotonic()
        if held and time.monotonic() - first_t >= max_wait_s:
            n = held
            yield take(n), dict(position), n
        elif chunk is None:
            yield None, dict(position), 0


def _format_of(path: Path, data_format: FileFormat | None) -> FileFormat:
    if data_format is not None:
        return data_format
    return "parquet" if path.name.endswith((".parquet", ".pq")) else "criteo"


def _file_position(name: str, first_row: int) -> Callable[[int], dict[str, Any]]:
    """A directory's position after the first j rows of a chunk that starts at row ``first_row`` of file ``name``."""
    return lambda j: {"file": name, "row": first_row + j}


def _message_position(partition: int, offset: int, base: int, rows: int) -> Callable[[int], dict[str, Any]]:
    """A partition's position after the first j rows of a chunk: the message's rows ``base`` onwards, of ``rows``
    (the next message once all are trained)."""
    return lambda j: {str(partition): [offset + 1, 0]} if base + j >= rows else {str(partition): [offset, base + j]}


@dataclass
class DirectorySource(SourceBase):
    """Criteo-format files of a directory in name order; with ``follow`` new files are trained as they land."""

    directory: Path
    sparse_fields: tuple[str, ...]
    follow: bool = True
    data_format: FileFormat | None = None
    poll_s: float = 0.5
    max_wait_s: float = 1.0
    drift: None = None
    _files: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.directory.is_dir():
            raise InvalidArgumentError(f"dir://{self.directory}: not a directory")
        CriteoFiles([], "criteo", self.sparse_fields)  # the same checks of the table names

    @property
    def bounded(self) -> bool:
        return not self.follow

    @property
    def num_dense(self) -> int:
        return len(DENSE_FIELDS)

    def _ready_files(self, after: str) -> list[Path]:
        names = sorted(p for p in self.directory.iterdir() if p.is_file() and not p.name.startswith(".")
                       and not p.name.endswith((".tmp", ".partial")) and p.name > after)
        return names

    def _chunks(self, position: dict[str, Any], stop: threading.Event) -> Iterator[Chunk | None]:
        current, skip = position.get("file", ""), int(position.get("row", 0))
        resume = self.directory / current if current else None
        done = current if current else ""
        while not stop.is_set():
            files = self._ready_files(done)
            if resume is not None:
                files = [resume, *files] if resume.is_file() else files
                resume = None
            for path in files:
                self._files.append(path)
                rows = skip if path.name == current else 0
                to_skip = rows
                files_reader = CriteoFiles([path], _format_of(path, self.data_format), self.sparse_fields)
                for rb in files_reader.record_batches(4096):
                    if stop.is_set():
                        return
                    if to_skip >= rb.num_rows:
                        to_skip -= rb.num_rows
                        continue
                    rb = rb.slice(to_skip)
                    to_skip = 0
                    yield Chunk(encode(rb, self.sparse_fields), _file_position(path.name, rows))
                    rows += rb.num_rows
                yield Chunk(_empty(self.sparse_fields), _file_position(path.name, rows))  # called with 0 only
                done, skip = path.name, 0
            if not self.follow:
                return
            yield None
            stop.wait(self.poll_s)

    def batches(self, batch_size: int, position: Any, rank: int = 0, world: int = 1,
                stop: threading.Event | None = None) -> Iterator[BatchItem]:
        state = dict(position or {})
        yield from assemble(self._chunks(state, stop or threading.Event()), batch_size, self.max_wait_s, state)

    def describe(self) -> dict:
        return {"format": "dir", "directory": str(self.directory), "follow": self.follow,
                "files_read": [p.name for p in self._files][-100:]}


def _empty(sparse_fields: tuple[str, ...]) -> Batch:
    return Batch(dense=np.zeros((0, len(DENSE_FIELDS)), np.float32),
                 sparse={f: np.zeros((0, 1), np.int64) for f in sparse_fields}, labels=np.zeros(0, np.float32))


def parse_kafka_url(url: str) -> tuple[str, str]:
    """``kafka://brokers/topic`` -> (brokers, topic)."""
    rest = url[len("kafka://"):]
    brokers, _, topic = rest.partition("/")
    if not brokers or not topic or "/" in topic:
        raise InvalidArgumentError(f"{url!r}: expected kafka://host:port[,host:port]/topic")
    return brokers, topic


class KafkaSource(SourceBase):
    """Click events from every partition of one topic, resumable at the exact row."""

    bounded = False
    drift = None

    def __init__(self, url: str, sparse_fields: tuple[str, ...], group: str, poll_s: float = 0.2,
                 max_wait_s: float = 1.0, consumer_config: dict[str, Any] | None = None) -> None:
        from confluent_kafka import Consumer

        from hps_service.updates.kafka_log import with_logging

        self.brokers, self.topic = parse_kafka_url(url)
        CriteoFiles([], "criteo", sparse_fields)  # the same checks of the table names
        self.sparse_fields = sparse_fields
        self.group = group
        self.poll_s, self.max_wait_s = poll_s, max_wait_s
        self.malformed = 0
        self._consumer = Consumer(with_logging({
            **(consumer_config or {}), "bootstrap.servers": self.brokers, "group.id": group,
            "enable.auto.commit": False, "auto.offset.reset": "error", "enable.partition.eof": False,
        }))
        meta = self._consumer.list_topics(self.topic, timeout=10)
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            self._consumer.close()
            raise UnavailableError(f"topic {self.topic!r} not found on {self.brokers}")
        self.partitions = sorted(topic.partitions)

    @property
    def num_dense(self) -> int:
        return len(DENSE_FIELDS)

    def _start(self, position: dict[str, Any]) -> dict[int, list[int]]:
        """Per partition (offset to read from, rows of that message already trained)."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        if position:
            return {int(p): [int(o), int(s)] for p, (o, s) in position.items()}
        committed = self._consumer.committed([TopicPartition(self.topic, p) for p in self.partitions], timeout=10)
        return {tp.partition: [tp.offset if tp.offset >= 0 else OFFSET_BEGINNING, 0] for tp in committed}

    def _decode(self, value: bytes, timestamp_ms: int) -> Batch:
        import pyarrow as pa

        if value.startswith(_PARQUET_MAGIC):
            import pyarrow.parquet as pq

            table = pq.read_table(pa.BufferReader(value))
        else:
            from pyarrow import csv

            read, parse, convert = tsv_options(block_rows=1 << 16)
            table = csv.read_csv(io.BytesIO(value), read_options=read, parse_options=parse, convert_options=convert)
        batch = encode(table, self.sparse_fields)
        if batch.time is None:
            batch.time = np.full(len(batch), timestamp_ms // 1000, dtype=np.int64)
        return batch

    def _chunks(self, position: dict[str, Any], stop: threading.Event) -> Iterator[Chunk | None]:
        from confluent_kafka import KafkaError, TopicPartition

        start = self._start(position)
        for part, (first, skip) in start.items():
            position[str(part)] = [first, skip]  # a logical offset (the start) until a message is read
        self._consumer.assign([TopicPartition(self.topic, p, o) for p, (o, _) in start.items()])
        skips = {p: (o, s) for p, (o, s) in start.items() if s}
        while not stop.is_set():
            msg = self._consumer.poll(self.poll_s)
            if msg is None:
                yield None
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal() or err.code() in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                    raise UnavailableError(f"reading {self.topic}: {err.str()} (a position below the log's start "
                                           "means samples were lost: start over without --resume)")
                log.warning("reading %s: %s (retrying)", self.topic, err.str())  # the client reconnects itself
                yield None
                continue
            p, offset = msg.partition(), msg.offset()
            assert p is not None and offset is not None, "a consumed message without an error has both"
            try:
                batch = self._decode(msg.value() or b"", msg.timestamp()[1])
            except (InvalidArgumentError, ValueError, OSError) as exc:  # pyarrow's errors are ValueError/OSError
                self.malformed += 1
                log.warning("skipping %s[%d]@%d: not a click log (%s)", self.topic, p, offset, exc)
                yield Chunk(_empty(self.sparse_fields), _message_position(p, offset, 0, 0))  # on to the next one
                continue
            expected = skips.pop(p, None)
            if expected is not None:
                if expected[0] != offset:
                    raise FailedPreconditionError(f"{self.topic}[{p}]: the checkpoint stopped inside message "
                                                  f"{expected[0]}, but the log now starts at {offset}")
                batch = batch.rows(slice(expected[1], None))
                base = expected[1]
            else:
                base = 0
            n = len(batch) + base
            yield Chunk(batch, _message_position(p, offset, base, n))

    def batches(self, batch_size: int, position: Any, rank: int = 0, world: int = 1,
                stop: threading.Event | None = None) -> Iterator[BatchItem]:
        state = dict(position or {})
        yield from assemble(self._chunks(state, stop or threading.Event()), batch_size, self.max_wait_s, state)

    def commit(self, position: Any) -> None:
        """Commit, for the group, the offset of the first message not wholly trained in every partition."""
        from confluent_kafka import KafkaException, TopicPartition

        if not position:
            return
        offsets = [TopicPartition(self.topic, int(p), int(o)) for p, (o, _) in position.items() if int(o) >= 0]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:  # the checkpoint holds the position; the group's copy is for monitoring
            log.warning("committing %s offsets for group %s failed: %s", self.topic, self.group, exc)

    def close(self) -> None:
        self._consumer.close()

    def describe(self) -> dict:
        return {"format": "kafka", "brokers": self.brokers, "topic": self.topic, "group": self.group,
                "partitions": len(self.partitions), "malformed_messages": self.malformed}
