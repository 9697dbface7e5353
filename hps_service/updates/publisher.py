"""The trainer-side SDK: publish embedding rows and tombstones to ``<prefix>.<model>``, routed by key hash."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Self

import numpy as np
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient

from hps_service.config import valid_name
from hps_service.errors import InvalidArgumentError, UnavailableError
from hps_service.rows.formats import row_format
from hps_service.updates.admin_signature import HEADER as SIGNATURE_HEADER
from hps_service.updates.admin_signature import sign
from hps_service.updates.consumed import ProduceHeaders, position
from hps_service.updates.kafka_log import with_logging
from hps_service.updates.message import MAX_MESSAGE_BYTES, encode_update, rows_per_message, topic_name
from hps_service.updates.partitioning import group_by_partition, partition_of
from hps_service.updates.topics import (
    DEFAULT_MIN_INSYNC_REPLICAS,
    DEFAULT_PARTITIONS,
    DEFAULT_REPLICATION_FACTOR,
    ensure_topic,
)

_PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 2,
    "compression.type": "none",
    # Our payload cap is 1 MiB; leave room for the record batch framing around it.
    "message.max.bytes": MAX_MESSAGE_BYTES + 64 * 1024,
}


def connection_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The security entries of a librdkafka config (security.protocol, sasl.*, ssl.*) that every client needs."""
    return {k: v for k, v in config.items() if k == "security.protocol" or k.startswith(("sasl.", "ssl."))}


class Deliveries:
    """The broker's acknowledgements of the messages of one call: pass it to ``publish``/``delete``/
    ``purge_tombstones`` and then to :meth:`Publisher.wait` (its errors are raised there, not by later calls)."""

    def __init__(self) -> None:
        self.pending = 0
        #: Highest acknowledged offset per partition.
        self.offsets: dict[int, int] = {}
        self.errors: list[str] = []
        self.fatal = False
        self._lock = threading.Lock()

    def sent(self) -> None:
        with self._lock:
            self.pending += 1

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        with self._lock:
            self.pending -= 1
            if err is not None:
                self.errors.append(f"{msg.topic()}[{msg.partition()}]: {err.str()}")
                self.fatal = self.fatal or err.fatal()
            else:
                _, partition, offset = position(msg)
                self.offsets[partition] = max(self.offsets.get(partition, -1), offset)


class Publisher:
    """Publishes versioned rows and deletes of one model; each key always goes to the same partition.

    Delivery errors reported by the broker are collected and raised by the next ``publish``/``delete``/``flush``.
    ``producer_config`` entries (librdkafka names, e.g. ``**{"linger.ms": 5}``) override the defaults.
    """

    def __init__(
        self,
        brokers: str,
        model: str,
        topic_prefix: str = "hps",
        *,
        partitions: int = DEFAULT_PARTITIONS,
        metadata_timeout_s: float = 10.0,
        replication_factor: int = DEFAULT_REPLICATION_FACTOR,
        min_insync_replicas: int = DEFAULT_MIN_INSYNC_REPLICAS,
        admin_key: str | None = None,
        precision: str = "fp32",
        model_version: int = 0,
        **producer_config: Any,
    ) -> None:
        """``admin_key``: updates.admin_key, which signs the admin-only messages (tombstone purges); replicas refuse
        them unsigned. ``precision``: publish rows as fp32 (default), fp16, bf16 or int8 rows (a 2-4x smaller
        log; replicas decode them and store each table in its own format). ``model_version`` > 0: the rows and
        deletes are of that version of the model (``POST /v1/models/{model}/versions``) and reach it only."""
        if not 0 <= model_version < 2**32:
            raise InvalidArgumentError(f"model_version must be in [0, 2**32), got {model_version}")
        if not valid_name(model):
            raise InvalidArgumentError(f"model name {model!r} is not valid (letters, digits, '_' and '-', <= 64)")
        if not brokers:
            raise InvalidArgumentError("brokers must be a non-empty 'host:port[,host:port]' string")
        row_format(precision, 1)  # InvalidArgumentError for an unknown precision, before connecting
        self.model = model
        self.model_version = model_version
        self.precision = precision
        self._admin_key = admin_key
        self.topic = topic_name(model, topic_prefix)
        self._conf = with_logging({**_PRODUCER_DEFAULTS, **producer_config, "bootstrap.servers": brokers})
        self._producer = Producer(self._conf)
        admin = AdminClient(with_logging({**connection_settings(producer_config), "bootstrap.servers": brokers}))
        self.partitions = ensure_topic(admin, self.topic, partitions, timeout_s=metadata_timeout_s,
                                       replication_factor=replication_factor, min_insync_replicas=min_insync_replicas)
        self._errors: list[str] = []
        self._fatal: list[str] = []  # fatal producer errors: the producer must be replaced before the next send
        self._lock = threading.Lock()
        self._on_delivery = self._delivery_callback(self._errors, self._fatal, self._lock)
        self.messages_sent = 0
        self.rows_sent = 0

    def publish(
        self, table: str, keys: np.ndarray, rows: np.ndarray, version: int | np.ndarray,
        deliveries: Deliveries | None = None,
    ) -> int:
        """Queue ``rows`` (n, dim) for ``keys`` (n,) at ``version`` (one int or one per row); returns messages queued."""
        self._check_table(table)
        keys = self._keys(keys, "keys")
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[0] != len(keys) or rows.shape[1] < 1:
            raise InvalidArgumentError(f"rows must have shape ({len(keys)}, dim >= 1), got {rows.shape}")
        if not (np.issubdtype(rows.dtype, np.floating) or np.issubdtype(rows.dtype, np.integer)):
            raise InvalidArgumentError(f"rows must be numeric (float32), got dtype {rows.dtype}")
        with np.errstate(over="ignore"):
            rows = np.ascontiguousarray(rows, dtype=np.float32)
        if not np.isfinite(rows).all():
            raise InvalidArgumentError("rows contain NaN or infinity (after conversion to float32)")
        row_format(self.precision, rows.shape[1]).check(rows)  # refused whole, before any message is queued
        versions = self._versions(version, len(keys))
        return self._send(table, keys, rows, versions, deletes=False, deliveries=deliveries)

    def delete(
        self, table: str, keys: np.ndarray, version: int | np.ndarray, deliveries: Deliveries | None = None
    ) -> int:
        """Queue tombstones for ``keys`` at ``version``: rows stored with an older version are removed everywhere."""
        self._check_table(table)
        keys = self._keys(keys, "keys")
        versions = self._versions(version, len(keys))
        return self._send(table, keys, None, versions, deletes=True, deliveries=deliveries)

    def purge_tombstones(self, table: str, below_version: int, deliveries: Deliveries | None = None) -> int:
        """Queue a purge of ``table``'s tombstones older than ``below_version`` to every partition (every replica and
        shard reads one); returns messages queued."""
        self._check_table(table)
        below = self._versions(below_version, 1)[0]
        if below == 0:
            return 0
        self._producer.poll(0)
        if deliveries is None:
            self._raise_delivery_errors()
        none = np.empty(0, dtype=np.int64)
        payload = encode_update(self.model, table, none, np.empty((0, 0), dtype=np.float32), none,
                                purge_tombstones_below=int(below), model_version=self.model_version)
        headers: ProduceHeaders | None = (
            [(SIGNATURE_HEADER, sign(self._admin_key, payload))] if self._admin_key is not None else None)
        for p in range(self.partitions):
            self._produce(p, payload, deliveries, headers)
        self.messages_sent += self.partitions
        return self.partitions

    def wait(self, deliveries: Deliveries, timeout: float = 30.0) -> dict[int, int]:
        """Wait until the broker acknowledged every message of ``deliveries``; returns the highest offset per
        partition. UnavailableError on a delivery error or when ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while deliveries.pending > 0 and time.monotonic() < deadline:
            self._producer.poll(0.01)
        if deliveries.fatal:
            self._producer.purge()
            self._producer = Producer(self._conf)
        if deliveries.errors:
            raise UnavailableError(f"{len(deliveries.errors)} update message(s) failed delivery; first: "
                                   f"{deliveries.errors[0]}")
        if deliveries.pending > 0:
            raise UnavailableError(f"{deliveries.pending} update message(s) not acknowledged by the broker within "
                                   f"{timeout}s")
        return dict(deliveries.offsets)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued message is acknowledged; raise UnavailableError on a delivery error or timeout."""
        remaining = self._producer.flush(timeout)
        self._raise_delivery_errors()
        if remaining:
            raise UnavailableError(f"{remaining} update message(s) not acknowledged by the broker within {timeout}s")

    def close(self, timeout: float = 30.0) -> None:
        """Flush and release the producer."""
        self.flush(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()

    def _send(
        self, table: str, keys: np.ndarray, rows: np.ndarray | None, versions: np.ndarray, deletes: bool,
        deliveries: Deliveries | None = None,
    ) -> int:
        self._producer.poll(0)
        if deliveries is None:
            self._raise_delivery_errors()
        if len(keys) == 0:
            return 0
        part = partition_of(keys, self.partitions)
        order, starts = group_by_partition(part, self.partitions)
        cap = rows_per_message(rows.shape[1] if rows is not None else 0, self.precision)
        empty_rows = np.empty((0, 0), dtype=np.float32)
        put_rows = empty_rows if rows is None else rows  # None only with deletes
        no_keys = np.empty(0, dtype=np.int64)
        sent = 0
        for p in np.flatnonzero(starts[1:] > starts[:-1]):
            for lo in range(int(starts[p]), int(starts[p + 1]), cap):
                idx = order[lo : min(lo + cap, int(starts[p + 1]))]
                if deletes:
                    payload = encode_update(self.model, table, no_keys, empty_rows, no_keys, keys[idx], versions[idx],
                                            model_version=self.model_version)
                else:
                    payload = encode_update(self.model, table, keys[idx], put_rows[idx], versions[idx],
                                            precision=self.precision, model_version=self.model_version)
                self._produce(int(p), payload, deliveries)
                sent += 1
        self.messages_sent += sent
        self.rows_sent += len(keys)
        return sent

    def _produce(self, partition: int, payload: bytes, deliveries: Deliveries | None = None,
                 headers: ProduceHeaders | None = None) -> None:
        deadline = time.monotonic() + 60.0
        while True:
            try:
                self._producer.produce(self.topic, value=payload, partition=partition, headers=headers,
                                       on_delivery=deliveries if deliveries is not None else self._on_delivery)
                if deliveries is not None:
                    deliveries.sent()
                return
            except BufferError:
                if time.monotonic() > deadline:
                    raise UnavailableError("producer queue stayed full for 60 s; is the broker reachable?") from None
                self._producer.poll(0.05)
            except KafkaException as exc:
                raise UnavailableError(f"could not queue an update for {self.topic}: {exc}") from None

    @staticmethod
    def _delivery_callback(
        errors: list[str], fatal: list[str], lock: threading.Lock
    ) -> Callable[[KafkaError | None, Message], None]:
        # A closure, not a bound method: the producer holding a reference to self would make a cycle that
        # keeps a dropped Publisher's producer alive (and reconnecting) until the garbage collector runs.
        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                with lock:
                    errors.append(f"{msg.topic()}[{msg.partition()}]: {err.str()}")
                    if err.fatal():
                        fatal.append(err.str())

        return on_delivery

    def _raise_delivery_errors(self) -> None:
        with self._lock:
            errors = self._errors[:]
            self._errors.clear()
            fatal = self._fatal[:]
            self._fatal.clear()
        if fatal:
            # An idempotent producer that lost its epoch (e.g. fenced after a broker outage) fails every later
            # message; a new one gets a new producer id. The failed messages are reported; publishing them
            # again is safe because rows carry versions.
            self._producer.purge()
            self._producer = Producer(self._conf)
        if errors:
            note = "; the producer hit a fatal error and was replaced: publish again" if fatal else ""
            raise UnavailableError(f"{len(errors)} update message(s) failed delivery; first: {errors[0]}{note}")

    @staticmethod
    def _check_table(table: str) -> None:
        if not isinstance(table, str) or not valid_name(table):
            raise InvalidArgumentError(f"table name {table!r} is not valid (letters, digits, '_' and '-', <= 64)")

    @staticmethod
    def _keys(keys: np.ndarray, what: str) -> np.ndarray:
        arr = np.asarray(keys)
        if arr.ndim != 1:
            raise InvalidArgumentError(f"{what} must be a 1-D array, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgumentError(f"{what} must be integers (int64), got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
            raise InvalidArgumentError(f"{what} do not fit in int64")
        return np.ascontiguousarray(arr, dtype=np.int64)

    @staticmethod
    def _versions(version: int | np.ndarray, n: int) -> np.ndarray:
        if isinstance(version, (int, np.integer)) and not isinstance(version, bool):
            if not 0 <= int(version) <= np.iinfo(np.int64).max:
                raise InvalidArgumentError(f"version must be in [0, 2**63), got {version}")
            return np.full(n, int(version), dtype=np.int64)
        arr = np.asarray(version)
        if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgumentError(f"version must be an int or an integer array of shape ({n},), got {arr.dtype} {arr.shape}")
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        if n and arr.min() < 0:
            raise InvalidArgumentError("versions must be >= 0")
        return arr
