"""The audit log: one JSON line per admin action on the REST API (who, what, which model and table, how many keys,
the outcome), to the ``hps.audit`` logger and, with ``server.audit_log``, to a file of its own.

An entry carries names and counts only: never a token (the caller is the token's name, ``admin``, or what was
wrong with the credential), never a row, never a request body.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

AUDIT_LOGGER = "hps.audit"
#: The key of a request's ``state`` holding its entry while it is served (the body parser adds the key count).
AUDIT_STATE = "hps_audit"
log = logging.getLogger(AUDIT_LOGGER)
_files: dict[Path, logging.Handler] = {}
_files_lock = threading.Lock()


def _for_file(path: str) -> Callable[[logging.LogRecord], bool]:
    """A log filter passing the records meant for the audit file ``path``."""

    def passes(record: logging.LogRecord) -> bool:
        return getattr(record, "audit_file", None) == path

    return passes


@dataclass
class AuditEntry:
    """One admin request, filled in as it is served."""

    who: str
    action: str
    method: str
    path: str
    model: str | None = None
    table: str | None = None
    #: Keys the request named (rows put, keys deleted); None when it names none.
    keys: int | None = None
    status: int = 0

    @property
    def outcome(self) -> str:
        if self.status in (401, 403):
            return "refused"
        return "ok" if 200 <= self.status < 400 else "failed"

    def line(self) -> str:
        return json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **asdict(self),
                           "outcome": self.outcome}, ensure_ascii=False, separators=(",", ":"))


class AuditLog:
    """Where entries go: the ``hps.audit`` logger (the process's log), and ``path`` when given (one handler per
    file and process, appended to, reopened when logrotate moves it)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        if path is not None:
            with _files_lock:
                if path not in _files:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    handler = logging.handlers.WatchedFileHandler(path, encoding="utf-8")
                    handler.setFormatter(logging.Formatter("%(message)s"))
                    handler.addFilter(_for_file(str(path)))
                    log.addHandler(handler)
                    _files[path] = handler
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)  # admin actions are logged whatever the process's level

    def record(self, entry: AuditEntry) -> None:
        log.info("%s", entry.line(), extra={"audit_file": str(self.path) if self.path is not None else None})
