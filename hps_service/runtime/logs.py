"""Logging of the ``hps`` processes: one line per record on stderr, as text or as one JSON object per line
(``server.log_format: json``), with the libraries' loggers (uvicorn, librdkafka via ``hps.kafka``) in the same
format. A line written while a call is served (tracing on) carries the call's ``request_id`` and ``trace_id``."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Literal

from hps_service.runtime.call_context import current_call

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Libraries whose DEBUG records carry credentials (botocore logs each request's signed Authorization header, the
#: access key in it) or whole request bodies: they log at INFO and above whatever the level asked for.
_QUIET_AT_DEBUG = ("botocore", "boto3", "s3transfer", "urllib3")
#: Attributes every LogRecord has; anything else was passed with ``extra=`` and goes into the JSON object.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class CallFilter(logging.Filter):
    """Adds ``request_id`` and ``trace_id`` to a record written while a call is served (JSON lines get them as
    fields, text lines as a ``[request_id=... trace_id=...]`` suffix); other records pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        call = current_call()
        if call is not None:
            record.request_id = call.request_id
            if call.trace_id:
                record.trace_id = call.trace_id
        return True


class TextFormatter(logging.Formatter):
    """``fmt`` plus the call's ids when the record has them (see :class:`CallFilter`)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request = getattr(record, "request_id", None)
        if request is None:
            return line
        trace = getattr(record, "trace_id", None)
        return f"{line} [request_id={request}" + (f" trace_id={trace}]" if trace else "]")


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


def setup_logging(level: str | int = "info", log_format: Literal["text", "json"] = "text",
                  text_format: str = TEXT_FORMAT) -> None:
    """Send every logger's records at ``level`` and above to stderr in ``log_format`` (replacing earlier handlers);
    ``text_format``: the line of a text record (a worker names itself in it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(text_format))
    handler.addFilter(CallFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for name in _QUIET_AT_DEBUG:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # their records reach the root handler only
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
