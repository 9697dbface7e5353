"""Shared pytest fixtures: real servers started for the session and stopped after."""
import os

import pytest

from tests.fixtures.kafka_broker import kafka_broker  # noqa: F401
from tests.fixtures.redis_cluster import redis_cluster, redis_cluster_clean  # noqa: F401
from tests.fixtures.seaweedfs import s3_server  # noqa: F401

pytest_plugins = ["tests.exit_watchdog"]

#: Tests marked ``long`` (minutes each) run only when this is set: ``HPS_RUN_LONG=1 make test``.
RUN_LONG = os.environ.get("HPS_RUN_LONG", "") not in ("", "0")


def pytest_configure(config: pytest.Config) -> None:
    """Give each pytest-xdist worker (and every process it starts) its own slice of the port range, so servers
    started by two workers at once never pick the same port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        os.environ["HPS_PORT_SLICE"] = f"{int(worker[2:])}/{os.environ['PYTEST_XDIST_WORKER_COUNT']}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if RUN_LONG:
        return
    skip = pytest.mark.skip(reason="a long run: set HPS_RUN_LONG=1 to include it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
