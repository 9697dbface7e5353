"""``hps import`` as a function: one table's rows from a HugeCTR sparse model directory, a ``.npz`` or torch weights
(a state_dict or safetensors file, the table's rows found by its name) into the persistent tier (RocksDB SST
ingest: all rows or none), used by ``hps import`` and ``hps config from-hugectr --import``."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hps_service.config import HPSConfig
from hps_service.errors import HPSError


class ImportRefused(Exception):
    """The import cannot be made; the message says why in one line."""


def import_source(cfg: HPSConfig, path: Path, model: str, table: str, *, version: int = 0, model_version: int = 0,
                  if_empty: bool = False, console: Console | None = None, source: str = "the config") -> str:
    """Import the rows at ``path`` into ``model.table`` of ``cfg`` (read from ``source``) in its RocksDB, with a
    progress bar on ``console``; returns the line that says what was done. ImportRefused names what stops it."""
    from hps_service.admin.importer import import_table, read_model_source
    from hps_service.config.base import served_name
    from hps_service.engine import version_drop
    from hps_service.engine.stored_tables import TableNames
    from hps_service.engine.ttl import now_s
    from hps_service.fleet.sharding import ShardMap
    from hps_service.rows import row_format
    from hps_service.tiers.rocksdb.tier import RocksDBTier

    mc = cfg.model(model)
    if mc is None:
        raise ImportRefused(f"model '{model}' is not in {source}")
    tc = mc.table(table)
    if tc is None:
        raise ImportRefused(f"model '{model}' has no table '{table}' in {source}")
    if cfg.persistent.type != "rocksdb":
        raise ImportRefused("import writes to the persistent tier, but persistent.type is disabled")
    if cfg.persistent.read_only:
        raise ImportRefused("import needs a writable persistent tier, but persistent.read_only is true")
    try:
        keys, vectors = read_model_source(path, table)
        keys, vectors, skipped = ShardMap.from_config(cfg.cluster).keep_owned(keys, vectors)
        tier = RocksDBTier(cfg.persistent.path, block_cache_mb=cfg.persistent.block_cache_mb)
    except HPSError as exc:
        raise ImportRefused(str(exc)) from None
    except Exception as exc:
        raise ImportRefused(f"cannot open {cfg.persistent.path}: {exc}") from None
    # a converted table is imported where and as it is stored now; a version's under its own tier id
    stored = TableNames(tier).claim(served_name(model, model_version), table)
    tid, storage = stored.id, stored.serving_storage(tc.storage)
    try:
        written_s = now_s() if tc.ttl_s is not None else None  # a TTL table's rows carry their write time
        version_drop.clear(tier, served_name(model, model_version))  # rows imported are wanted: no drop to finish
        tier.create_table(tid, row_format(storage, tc.dim, stamped=written_s is not None).words)
        if if_empty and tier.count(tid) > 0:
            return f"{tid} already holds rows; skipping import (--if-empty)"
        with Progress(TextColumn(f"importing {tid}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=console or Console(stderr=True), transient=True) as progress:
            task = progress.add_task("import", total=int(keys.shape[0]))
            n = import_table(
                tier, tid, tc.dim, keys, vectors, version=version, storage=storage, written_s=written_s,
                progress=lambda done: progress.update(task, completed=done),
            )
    except HPSError as exc:
        raise ImportRefused(str(exc)) from None
    finally:
        tier.close()
    shard = ""
    if cfg.cluster.shards > 1:
        shard = (f"; skipped {skipped} rows of other shards (this is shard {cfg.cluster.shard} of "
                 f"{cfg.cluster.shards})")
    return f"imported {n} rows (dim {tc.dim}) into {tid} at {cfg.persistent.path}{shard}"
