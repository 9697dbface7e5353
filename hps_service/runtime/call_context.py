"""The call a thread (or task) is serving: its request id and trace id, which every log line written meanwhile
carries (:class:`hps_service.runtime.logs.CallFilter`). Set only while tracing is on (``server.tracing``)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from hps_service.errors import InvalidArgumentError

#: The gRPC metadata key and HTTP header of a caller's request id (lower case, as gRPC metadata keys are).
REQUEST_ID = "x-request-id"
#: A request id is printable ASCII without spaces, at most this long (a UUID is 36): it goes into log lines and spans.
MAX_REQUEST_ID = 128
_REQUEST_ID_RE = re.compile(rf"^[\x21-\x7e]{{1,{MAX_REQUEST_ID}}}$")


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What identifies one call in the logs: the caller's (or a new) request id and the call's trace id (32 hex
    digits; empty when the call is not traced)."""

    request_id: str
    trace_id: str = ""


_CURRENT: ContextVar[CallInfo | None] = ContextVar("hps_call", default=None)


def current_call() -> CallInfo | None:
    """The call being served in this context, if any."""
    return _CURRENT.get()


def request_id(given: str | None) -> str:
    """The caller's request id, checked (InvalidArgumentError naming the problem), or a new one (16 hex digits)."""
    if given is None:
        return os.urandom(8).hex()
    if not _REQUEST_ID_RE.match(given):
        raise InvalidArgumentError(
            f"{REQUEST_ID} must be 1 to {MAX_REQUEST_ID} printable ASCII characters without spaces "
            f"(got {len(given)} characters)")
    return given


@contextmanager
def serving(call: CallInfo) -> Iterator[CallInfo]:
    """Make ``call`` the current call for the duration of the block (a handler thread serves many calls)."""
    token = _CURRENT.set(call)
    try:
        yield call
    finally:
        _CURRENT.reset(token)
