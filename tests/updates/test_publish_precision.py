"""Updates published as fp16 / bf16 / int8 rows (``--publish-precision``): smaller messages, decoded by the consumer
and stored in each table's own format, within the formats' error bounds."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.config import HPSConfig, ModelConfig, TableConfig
from hps_service.errors import InvalidArgumentError
from hps_service.proto.hps.v1.update_pb2 import EmbeddingUpdate
from hps_service.serve.build import build_engine
from hps_service.updates import Publisher, UpdateConsumer, make_version
from hps_service.updates.message import MalformedUpdateError, decode_update, encode_update, rows_per_message
from tests.updates.conftest import served, wait_until
from tests.updates.test_publisher import read_all

DIM = 64


def sample_rows(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, DIM)) * 0.1).astype(np.float32)


def error_bound(precision: str, rows: np.ndarray) -> np.ndarray:
    """Largest error per row a ``precision`` row may carry: half an ulp (fp16 / bf16) or half a code step (int8)."""
    mag = np.abs(rows).max(axis=1)
    if precision == "fp16":
        return np.maximum(mag * 2.0**-11, 2.0**-25)
    if precision == "bf16":
        return mag * 2.0**-8
    if precision == "int8":
        return (rows.max(axis=1) - rows.min(axis=1)) / 255 / 2 * 1.0001 + 1e-7
    return np.zeros(rows.shape[0])


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_message_carries_stored_rows_decoded_within_bound(precision: str) -> None:
    keys = np.arange(500, dtype=np.int64)
    rows = sample_rows(500)
    versions = np.full(500, 7, dtype=np.int64)
    fp32 = encode_update("m", "t", keys, rows, versions)
    small = encode_update("m", "t", keys, rows, versions, precision=precision)
    assert EmbeddingUpdate.FromString(small).storage == {"fp16": 1, "bf16": 2, "int8": 3}[precision]
    ratio = len(small) / len(fp32)
    assert ratio < {"fp16": 0.6, "bf16": 0.6, "int8": 0.45}[precision], ratio  # keys and versions stay 16 B a row
    upd = decode_update(small)
    assert upd.vectors.dtype == np.float32 and upd.vectors.shape == (500, DIM)
    err = np.abs(upd.vectors - rows).max(axis=1)
    assert (err <= error_bound(precision, rows)).all()
    np.testing.assert_array_equal(upd.keys, keys)
    assert rows_per_message(DIM, precision) > 1.6 * rows_per_message(DIM)


def test_malformed_stored_rows_are_refused() -> None:
    keys = np.arange(4, dtype=np.int64)
    msg = EmbeddingUpdate.FromString(encode_update("m", "t", keys, sample_rows(4), keys, precision="int8"))
    msg.vectors = msg.vectors[:-4]
    with pytest.raises(MalformedUpdateError, match="4 int8 rows of dim 64 need"):
        decode_update(msg.SerializeToString())
    msg = EmbeddingUpdate.FromString(encode_update("m", "t", keys, sample_rows(4), keys))
    msg.storage = 9  # type: ignore[assignment]
    with pytest.raises(MalformedUpdateError, match="unknown row storage 9"):
        decode_update(msg.SerializeToString())
    msg = EmbeddingUpdate.FromString(encode_update("m", "t", keys, sample_rows(4), keys, precision="bf16"))
    msg.vectors = np.full(4 * DIM, 0x7F80, np.uint16).tobytes()  # bf16 infinities
    with pytest.raises(MalformedUpdateError, match="NaN or infinity"):
        decode_update(msg.SerializeToString())


def test_rows_beyond_fp16_are_refused_before_any_message_is_queued(kafka_broker, model_name) -> None:
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4, precision="fp16")
    keys = np.arange(1000, dtype=np.int64)
    rows = sample_rows(1000)
    rows[-1, 0] = 70_000.0  # the last row, on some partition after the others
    with pytest.raises(InvalidArgumentError, match="beyond fp16's range"):
        pub.publish("item", keys, rows, 1)
    pub.flush()
    assert read_all(kafka_broker.bootstrap, pub.topic, 4, expect=1, timeout=3) == []  # not even the first partitions
    pub.close()


def test_unknown_precision_refused_before_connecting() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown row storage 'int4'"):
        Publisher("127.0.0.1:1", "m", precision="int4")


@pytest.mark.parametrize(("precision", "storage"), [("int8", "fp32"), ("fp16", "int8"), ("bf16", "bf16")])
def test_consumer_applies_stored_rows_into_the_tables_format(kafka_broker, updates_cfg, tmp_path, model_name,
                                                            precision: str, storage: str) -> None:
    config = HPSConfig(
        cache={"backend": "numpy", "capacity": 10_000, "warm_start": False},
        volatile={"type": "hashmap", "capacity_rows": 100_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        models=[ModelConfig(name=model_name, tables=[TableConfig(name="item", dim=DIM, storage=storage)])],
    )
    engine = build_engine(config)
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=4)
    consumer.start()
    try:
        assert consumer.wait_ready(30), consumer.stats()
        keys = np.arange(3000, dtype=np.int64) * 13 - 1000
        rows = sample_rows(3000, seed=1)
        with Publisher(kafka_broker.bootstrap, model_name, partitions=4, precision=precision) as pub:
            pub.publish("item", keys, rows, make_version(0, 1))
        bound = error_bound(precision, rows) + error_bound(storage, rows) * 1.01

        def within() -> bool:
            got, _ = served(engine, model_name, keys, table="item")
            return bool((np.abs(got - rows).max(axis=1) <= bound).all())

        assert wait_until(within, timeout=60), consumer.stats()
        assert consumer.stats()["malformed"] == {}
    finally:
        consumer.stop()
        engine.close()
