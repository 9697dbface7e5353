"""``cache.enabled``: ``auto`` (the default) keeps L1 where it is the only fast copy (a GPU, a remote volatile tier or
none) and leaves it out where it would be a second host copy of this node's hash map; true and false win."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps_service.cache.backend import device_status
from hps_service.config import ConfigError, load_config
from hps_service.engine.l1_choice import l1_enabled
from hps_service.engine.levels import CACHE, VOLATILE
from hps_service.serve.build import build_engine

REDIS = {"type": "redis_cluster", "nodes": ["127.0.0.1:1"]}


@pytest.fixture
def no_device(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    device_status.cache_clear()
    if device_status()[0]:
        pytest.skip("a CUDA device is usable here: auto puts L1 on it")
    yield
    device_status.cache_clear()


def test_auto_is_the_default_and_words_parse() -> None:
    assert load_config(None).cache.enabled == "auto"
    for given, want in (("auto", "auto"), ("AUTO", "auto"), (True, True), ("false", False), ("off", False)):
        assert load_config(None, cache={"enabled": given}).cache.enabled == want
    for bad in ("maybe", 2, None):
        with pytest.raises(ConfigError, match="config key 'cache.enabled': must be true, false or auto"):
            load_config(None, cache={"enabled": bad})


def test_auto_on_the_cpu_leaves_l1_out_only_in_front_of_the_local_hash_map(no_device: None) -> None:
    for backend in ("auto", "numpy"):
        cfg = load_config(None, cache={"backend": backend})
        assert not l1_enabled(cfg.cache, cfg.volatile)
    redis = load_config(None, volatile=REDIS)
    assert l1_enabled(redis.cache, redis.volatile)
    none = load_config(None, volatile={"type": "disabled"})
    assert l1_enabled(none.cache, none.volatile)


def test_explicit_settings_win(no_device: None) -> None:
    on = load_config(None, cache={"enabled": True})
    assert l1_enabled(on.cache, on.volatile)
    off = load_config(None, cache={"enabled": False}, volatile=REDIS)
    assert not l1_enabled(off.cache, off.volatile)


def test_auto_keeps_l1_on_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numba CUDA simulator is a usable device to the backend's choice: L1 goes there, in front of the hash map."""
    pytest.importorskip("numba.cuda")
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    device_status.cache_clear()
    try:
        cfg = load_config(None)
        assert l1_enabled(cfg.cache, cfg.volatile)
        host = load_config(None, cache={"backend": "numpy"})
        assert not l1_enabled(host.cache, host.volatile)
    finally:
        device_status.cache_clear()


@pytest.mark.parametrize("enabled", ["auto", True])
def test_a_served_engine_follows_the_choice(no_device: None, tmp_path: Path, enabled: str | bool) -> None:
    cfg = load_config(None, cache={"enabled": enabled, "backend": "numpy"},
                      persistent={"path": str(tmp_path / "db")},
                      models=[{"name": "m", "tables": [{"name": "t", "dim": 4}]}])
    engine = build_engine(cfg)
    try:
        keys = np.arange(8, dtype=np.int64)
        engine.apply_updates("m", "t", keys, np.ones((8, 4), np.float32), 1)
        t = engine.table("m", "t")
        assert (t.cache is None) == (enabled == "auto")
        engine.lookup("m", "t", keys)
        got = engine.lookup("m", "t", keys)
        assert (got.sources == (VOLATILE if enabled == "auto" else CACHE)).all()
    finally:
        engine.close()
