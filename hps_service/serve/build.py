"""The composition root of one serving process: the tiers and the engine from config, and where it keeps files."""

from __future__ import annotations

import logging
from pathlib import Path

from hps_service.config import HPSConfig
from hps_service.engine import LookupEngine
from hps_service.engine.l1_sizing import l1_cache_factory
from hps_service.fleet.registrations import serve_registered
from hps_service.tiers.registry import open_tiers

log = logging.getLogger(__name__)


def build_engine(config: HPSConfig) -> LookupEngine:
    """Open the configured tiers and load every configured model into a LookupEngine."""
    volatile, persistent = open_tiers(config.volatile, config.persistent)
    engine = LookupEngine(
        volatile=volatile,
        persistent=persistent,
        cache_factory=l1_cache_factory(config, volatile, persistent),
        max_batch_keys=config.server.max_batch_keys,
    )
    for model in config.models:
        engine.register_model(model)
    serve_registered(engine, {m.name for m in config.models})
    return engine


def staging_root(config: HPSConfig) -> Path:
    """Where rows downloaded from object storage wait for their import: a ``staging`` directory beside the DB."""
    return Path(config.persistent.path).parent / "staging"


def snapshots_root(config: HPSConfig) -> Path:
    """Where RocksDB checkpoints go: server.snapshots_path, else a ``snapshots`` directory beside the DB."""
    if config.server.snapshots_path is not None:
        return Path(config.server.snapshots_path)
    return Path(config.persistent.path).parent / "snapshots"
