"""Every tier class declares its capabilities as data, and declares exactly the optional methods it implements; the
node's read-only views have no write methods at all."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import numpy as np
import pytest

import hps_service.tiers
from hps_service.errors import UnavailableError
from hps_service.node.reader_tiers import CaughtUpSecondary, SharedVolatile
from hps_service.tiers.base import ReadTier, Tier, TierCapability, tier_can
from hps_service.tiers.deferred import DeferredTier
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.redis import RedisClusterTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

#: The capabilities that name an optional :class:`Tier` method (WRITES names put, delete and write, which all have).
METHODS = {TierCapability.CHECKPOINT: "checkpoint", TierCapability.EXPORT: "export",
           TierCapability.BULK_IMPORT: "bulk_import"}
KNOWN = {HashMapTier, RedisClusterTier, RocksDBTier, DeferredTier, SharedVolatile, CaughtUpSecondary}


def _tier_classes() -> set[type[ReadTier]]:
    """Every concrete tier class in hps_service.tiers and the node's reader tiers."""
    for mod in pkgutil.iter_modules(hps_service.tiers.__path__):
        importlib.import_module(f"hps_service.tiers.{mod.name}")
    found: set[type[ReadTier]] = set()
    todo = [c for c in ReadTier.__subclasses__() if c is not Tier] + list(Tier.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("hps_service."):
            found.add(cls)
    return found


def test_every_tier_class_declares_its_capabilities() -> None:
    classes = _tier_classes()
    assert classes >= KNOWN
    for cls in classes:
        assert "capabilities" in vars(cls), f"{cls.__name__} does not declare its capabilities"
        assert isinstance(cls.capabilities, TierCapability)


@pytest.mark.parametrize("cls", sorted(KNOWN, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_a_capability_is_declared_exactly_where_its_method_is_implemented(cls: type[ReadTier]) -> None:
    for capability, method in METHODS.items():
        implemented = getattr(cls, method, None) not in (None, getattr(Tier, method))
        assert (capability in cls.capabilities) == implemented, f"{cls.__name__}: {capability} vs .{method}"


def test_the_base_refuses_what_a_tier_does_not_declare() -> None:
    tier = HashMapTier(capacity_rows=16)
    tier.create_table("m.t", 2)
    assert tier.capabilities == TierCapability.WRITES
    with pytest.raises(NotImplementedError, match="HashMapTier cannot bulk-import"):
        tier.bulk_import("m.t", np.arange(2, dtype=np.int64), np.ones((2, 2), np.float32))
    with pytest.raises(NotImplementedError, match="HashMapTier cannot checkpoint"):
        tier.checkpoint(Path("unused"))
    with pytest.raises(NotImplementedError, match="HashMapTier cannot scan entries"):
        tier.scan("m.t", None, 10)
    assert tier.put("m.t", np.arange(2, dtype=np.int64), np.ones((2, 2), np.float32), np.ones(2, np.int64)).all()


def test_a_read_only_rocksdb_lacks_writes_but_keeps_the_rest(tmp_path: Path) -> None:
    writable = RocksDBTier(tmp_path / "db", block_cache_mb=8)
    writable.create_table("m.t", 2)
    assert tier_can(writable, TierCapability.WRITES | TierCapability.CHECKPOINT | TierCapability.EXPORT
                    | TierCapability.BULK_IMPORT | TierCapability.SCAN)
    writable.close()
    ro = RocksDBTier(tmp_path / "db", read_only=True, block_cache_mb=8)
    try:
        assert ro.capabilities == (TierCapability.CHECKPOINT | TierCapability.EXPORT | TierCapability.BULK_IMPORT
                                   | TierCapability.SCAN)
        assert RocksDBTier.capabilities & TierCapability.WRITES  # the instance's, not the class's
        with pytest.raises(UnavailableError):
            ro.put("m.t", np.arange(1, dtype=np.int64), np.ones((1, 2), np.float32), np.ones(1, np.int64))
    finally:
        ro.close()


def test_the_workers_read_only_tiers_declare_no_writes_and_have_no_write_methods() -> None:
    for cls in (SharedVolatile, CaughtUpSecondary):
        assert not issubclass(cls, Tier) and cls.capabilities == TierCapability(0)
        assert not any(hasattr(cls, m) for m in ("put", "delete", "write", "create_table", "drop_table")), cls


def test_a_disabled_tier_can_nothing() -> None:
    for capability in TierCapability:
        assert not tier_can(None, capability)
