"""librdkafka's log lines go through Python logging (logger ``hps.kafka``), formatted and filtered like every other
line of the process (``server.log_format``), instead of raw ``%3|...|FAIL|...`` lines on stderr."""

from __future__ import annotations

import logging
from typing import Any

KAFKA_LOG = logging.getLogger("hps.kafka")


def with_logging(config: dict[str, Any]) -> dict[str, Any]:
    """A librdkafka client config whose log lines reach ``hps.kafka``."""
    return {**config, "logger": KAFKA_LOG}
