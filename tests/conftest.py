"""Shared pytest fixtures: real servers started for the session and stopped after."""
import faulthandler
import os
import sys
import threading
import time

import pytest

from tests.fixtures.kafka_broker import kafka_broker  # noqa: F401
from tests.fixtures.redis_cluster import redis_cluster, redis_cluster_clean  # noqa: F401
from tests.fixtures.seaweedfs import s3_server  # noqa: F401

_EXIT_STATUS = pytest.StashKey[int]()

#: Tests marked ``long`` (minutes each) run only when this is set: ``HPS_RUN_LONG=1 make test``.
RUN_LONG = os.environ.get("HPS_RUN_LONG", "") not in ("", "0")


#: How long the interpreter may take to exit once pytest is done before the watchdog ends it.
EXIT_GRACE_S = 60.0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Bound the interpreter's exit: a librdkafka client that a failed test left open can block it forever
    (confluent-kafka-python#1667: ``close()`` with its broker gone), which once held CI until its time ran out. After
    ``EXIT_GRACE_S`` every thread's stack goes to stderr and the process exits with pytest's own status; should the
    interpreter be past running Python threads by then, faulthandler's own C thread ends it 30 s later (status 1)."""
    status = config.stash.get(_EXIT_STATUS, 1)
    faulthandler.dump_traceback_later(EXIT_GRACE_S + 30, exit=True)

    def watchdog() -> None:
        time.sleep(EXIT_GRACE_S)
        print(f"\npytest finished but the process did not exit within {EXIT_GRACE_S:.0f} s; its threads:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(status)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if RUN_LONG:
        return
    skip = pytest.mark.skip(reason="a long run: set HPS_RUN_LONG=1 to include it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
