"""A consumed Kafka message's position and headers, typed as a consumer gets them (confluent-kafka's stubs type the
accessors of a message being built too: no topic, partition or offset yet, headers in any produce form)."""

from __future__ import annotations

from typing import NamedTuple, cast

from confluent_kafka import Message

Headers = list[tuple[str, bytes | None]]
#: Headers as a producer takes them.
ProduceHeaders = list[tuple[str, str | bytes | None]]


class Position(NamedTuple):
    """Where a consumed message sits in its log."""

    topic: str
    partition: int
    offset: int


def position(msg: Message) -> Position:
    """The topic, partition and offset of ``msg``, a message a consumer returned (a message with an error too)."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError("a message without a position: not one a consumer returned")
    return Position(topic, partition, offset)


def headers(msg: Message) -> Headers | None:
    """The headers of a consumed message: (name, value) pairs in their order, None without any."""
    return cast(Headers | None, msg.headers())
