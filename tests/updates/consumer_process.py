"""A consumer in its own process, for the SIGKILL test: ``python -m tests.updates.consumer_process BROKERS MODEL
GROUP DBPATH``. It prints the rows it has received, one line every few batches, until it is killed."""

from __future__ import annotations

import sys
import time

from hps_service.config import UpdatesConfig
from hps_service.updates import UpdateConsumer
from tests.updates.conftest import make_engine


def main() -> None:
    brokers, model, group, path = sys.argv[1:5]
    engine = make_engine(path, model)
    consumer = UpdateConsumer(
        UpdatesConfig(type="kafka", brokers=brokers), engine, [model], group, partitions=4, batch_messages=4
    )
    consumer.start()
    consumer.wait_ready(30)
    while True:
        print(consumer.metrics.rows_received, flush=True)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
