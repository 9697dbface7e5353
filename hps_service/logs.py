"""Logging of the ``hps`` processes: one line per record on stderr, as text or as one JSON object per line
(``server.log_format: json``), with the libraries' loggers (uvicorn, librdkafka via ``hps.kafka``) in the same
format."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Literal

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Libraries whose DEBUG records carry credentials (botocore logs each request's signed Authorization header, the
#: access key in it) or whole request bodies: they log at INFO and above whatever the level asked for.
_QUIET_AT_DEBUG = ("botocore", "boto3", "s3transfer", "urllib3")
#: Attributes every LogRecord has; anything else was passed with ``extra=`` and goes into the JSON object.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, exception and ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value if isinstance(value, str | int | float | bool | None) else repr(value)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str = "info", log_format: Literal["text", "json"] = "text") -> None:
    """Send every logger's records at ``level`` and above to stderr in ``log_format`` (replacing earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in _QUIET_AT_DEBUG:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # their records reach the root handler only
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
