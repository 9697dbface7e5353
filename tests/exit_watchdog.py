"""A pytest plugin that bounds the test process's exit.

A librdkafka client that a failed test left open, its broker gone, can block the interpreter's exit for ever
(confluent-kafka-python#1667: ``close()``, or the close of a collected client, waiting on a dead broker), which once
held CI until its time ran out. So once pytest is done:
- the atexit callbacks run as usual (those of multiprocessing and concurrent.futures included: children are ended),
  then the process exits with pytest's own status, skipping the interpreter's finalization, where collected clients
  would close;
- a hang before that (a thread that never ends, a callback that blocks) is ended after ``EXIT_GRACE_S``: every
  thread's stack goes to stderr and the process exits with pytest's status;
- should Python threads no longer run by then, faulthandler's own thread ends it 30 s later (status 1).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import time

import pytest

#: How long the process may take to exit once pytest is done before the watchdog ends it.
EXIT_GRACE_S = 60.0

_status: list[int] = []


def _exit_now() -> None:
    """The last atexit callback (registered before any other the tests cause): exit with pytest's status."""
    if _status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[0])


atexit.register(_exit_now)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status[:] = [int(exitstatus)]


def pytest_unconfigure(config: pytest.Config) -> None:
    status = _status[0] if _status else 1
    faulthandler.dump_traceback_later(EXIT_GRACE_S + 30, exit=True)

    def watchdog() -> None:
        time.sleep(EXIT_GRACE_S)
        print(f"\npytest finished but the process did not exit within {EXIT_GRACE_S:.0f} s; its threads:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(status)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
