"""Fixtures for update tests: a real engine (hash map L2 + RocksDB L3) and unique model names per test."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hps_service.config import HPSConfig, ModelConfig, TableConfig, UpdatesConfig
from hps_service.engine import LookupEngine
from hps_service.serve.build import build_engine

TABLE = "item"
DIM = 16


@pytest.fixture
def model_name() -> str:
    """A model name no other test uses, so each test gets fresh topics on the shared broker."""
    return f"m{uuid.uuid4().hex[:10]}"


@pytest.fixture
def updates_cfg(kafka_broker) -> UpdatesConfig:
    return UpdatesConfig(type="kafka", brokers=kafka_broker.bootstrap, topic_prefix="hps")


def make_engine(path, model: str, tables: dict[str, int] | None = None, cache_rows: int = 200_000) -> LookupEngine:
    """The server's engine (NumPy L1 cache, hash map L2, RocksDB L3 at ``path``) serving ``model``."""
    tables = tables or {TABLE: DIM}
    config = HPSConfig(
        cache={"enabled": True, "backend": "numpy", "capacity": cache_rows, "warm_start": False},
        volatile={"type": "hashmap", "capacity_rows": 1_000_000},
        persistent={"type": "rocksdb", "path": str(path), "block_cache_mb": 8},
        models=[ModelConfig(name=model, tables=[TableConfig(name=t, dim=d) for t, d in tables.items()])],
    )
    return build_engine(config)


@pytest.fixture
def engine(tmp_path, model_name) -> Iterator[LookupEngine]:
    eng = make_engine(tmp_path / "db", model_name)
    yield eng
    eng.close()


def rows_for(keys: np.ndarray, version: int | np.ndarray, dim: int = DIM) -> np.ndarray:
    """Deterministic rows that encode key and version, so a served row tells which write it came from."""
    keys = np.asarray(keys, dtype=np.int64)
    version = np.broadcast_to(np.asarray(version, dtype=np.int64), keys.shape)
    base = (keys.astype(np.float64) * 1e-3 + version.astype(np.float64)).astype(np.float32)
    return base[:, None] + np.arange(dim, dtype=np.float32)[None, :] * np.float32(1e-4)


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or the timeout passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def served(engine: LookupEngine, model: str, keys: np.ndarray, table: str = TABLE) -> tuple[np.ndarray, np.ndarray]:
    """Vectors and sources of ``keys`` through engine.lookup, in chunks under max_batch_keys."""
    vecs, srcs = [], []
    for lo in range(0, keys.shape[0], 50_000):
        r = engine.lookup(model, table, keys[lo : lo + 50_000])
        vecs.append(r.vectors)
        srcs.append(r.sources)
    return np.concatenate(vecs), np.concatenate(srcs)


def stored_versions(engine: LookupEngine, model: str, keys: np.ndarray, table: str = TABLE) -> dict[str, tuple]:
    """(found, versions) of ``keys`` in each tier, read directly from the tiers."""
    tid = f"{model}.{table}"
    out = {}
    for name, tier in (("volatile", engine.volatile), ("persistent", engine.persistent)):
        rows = tier.get(tid, keys)
        out[name] = (rows.found.copy(), rows.versions.copy())
    return out
