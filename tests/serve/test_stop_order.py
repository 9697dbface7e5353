"""HPSServer.stop() against a real broker and RocksDB: the tiers never close under the update consumer's write, even
when the consumer's join times out (issue 14, defect 7)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np

from hps_service.config import load_config
from hps_service.serve.process import HPSServer
from hps_service.tiers.rocksdb.tier import RocksDBTier
from hps_service.updates import Publisher
from tests.engine.seams import PATIENCE_S, Pause, Side, Watch, finished_or_blocked
from tests.helpers import free_port


def test_stop_waits_for_the_consumers_write_before_closing_the_tiers(kafka_broker, tmp_path: Path) -> None:
    model = f"m{uuid.uuid4().hex[:10]}"
    db = tmp_path / "db"
    cfg = load_config(
        None,
        server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "grace_period_s": 4.0},
        cache={"backend": "numpy", "capacity": 1024},
        persistent={"type": "rocksdb", "path": str(db), "block_cache_mb": 8},
        updates={"type": "kafka", "brokers": kafka_broker.bootstrap, "group": f"g-{model}"},
        models=[{"name": model, "tables": [{"name": "t", "dim": 4}]}],
    )
    srv = HPSServer(cfg)
    srv.start()
    assert srv.consumer is not None and srv.consumer.wait_ready(30)
    assert srv.consumer._thread is not None and srv.engine is not None
    l3_write = Pause(srv.engine.persistent, "write", thread=srv.consumer._thread.name, after=False)
    keys = np.arange(100, dtype=np.int64)
    publisher = Publisher(kafka_broker.bootstrap, model)
    publisher.publish("t", keys, np.ones((100, 4), np.float32), 1)
    publisher.flush(10)
    l3_write.wait_reached()  # the consumer is inside its write and stays there until stop() gave up joining it
    closing = Watch(srv.engine, "close")
    stopper = Side("stop", lambda: srv.stop())
    stopper.start()
    closing.wait_called()
    finished_or_blocked(stopper)
    l3_write.release()
    stopper.finish()
    srv.consumer._thread.join(PATIENCE_S)
    assert not srv.consumer._thread.is_alive()
    store = RocksDBTier(db, read_only=True)
    try:  # the write completed on an open store (before: RocksDB was closed under it and the rows were lost)
        written = l3_write.args[0][0].keys  # the consumer writes its batch (rows and positions) in one call
        assert written.shape[0] and store.get(f"{model}.t", written).found.all()
    finally:
        store.close()
