"""Dead letters: messages the consumer cannot apply go, unchanged and with the reason in their headers, to
``<topic>.dlq``. Their source offsets may be stored as applied only once the broker acknowledged them, so a refused
dead letter is produced again rather than dropped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from hps_service.updates.consumed import ProduceHeaders, position
from hps_service.updates.consumed import headers as consumed_headers
from hps_service.updates.message import dlq_topic_name

log = logging.getLogger(__name__)


class DeadLetters:
    """An idempotent producer for the dead-letter topics, and the letters the broker refused (produced again)."""

    def __init__(self, client_config: dict[str, Any], on_error: Callable[[str], None]) -> None:
        """``on_error(text)`` hears of every refused letter (which is then produced again)."""
        self._producer = Producer({**client_config, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
        self._failed: list[tuple[str, bytes | None, ProduceHeaders]] = []
        self._on_error = on_error
        #: Letters produced so far (a change tells the consumer its batch has some to wait for).
        self.sent = 0

    def send(self, msg: Message, reason: str) -> None:
        """Produce ``msg`` to its topic's dead-letter topic, with ``reason`` and its source position as headers."""
        self.sent += 1
        source = position(msg)
        headers: ProduceHeaders = [
            ("hps-error", reason.encode()),
            ("hps-source", f"{source.topic}[{source.partition}]@{source.offset}".encode()),
        ]
        self._produce(dlq_topic_name(source.topic), msg.value(), headers)

    def poll(self) -> None:
        """Serve delivery reports and produce again what the broker refused."""
        self._producer.poll(0)
        self._retry_failed()

    @property
    def outstanding(self) -> bool:
        """Whether some letter is not acknowledged yet (queued, in flight, or refused and waiting to go again)."""
        return bool(len(self._producer)) or bool(self._failed)

    def delivered(self, stopping: threading.Event) -> bool:
        """Wait until the broker acknowledged every letter produced so far; False when ``stopping`` is set first."""
        while True:
            if not self.outstanding:
                return True
            self._producer.flush(0.5)
            self._retry_failed()
            if stopping.is_set():
                return False

    def flush(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the letters in flight; whether every one was acknowledged."""
        if len(self._producer):
            self._producer.flush(timeout_s)
        return not self.outstanding

    def _retry_failed(self) -> None:
        if self._failed:
            retry, self._failed = self._failed, []
            for topic, value, headers in retry:
                self._produce(topic, value, headers)

    def _produce(self, topic: str, value: bytes | None, headers: ProduceHeaders) -> None:
        while True:
            try:
                self._producer.produce(topic, value=value, headers=headers, on_delivery=self._on_delivery)
                return
            except BufferError:
                self._producer.poll(0.05)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            text = f"dead letter to {msg.topic()} failed: {err.str()}"
            log.warning("%s; producing it again", text)
            self._on_error(text)
            topic = msg.topic()
            if topic is not None:  # set on every message produced
                self._failed.append((topic, msg.value(), list(consumed_headers(msg) or [])))
