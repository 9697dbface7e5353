"""``hps import`` as a function: one table's rows from a ``.npz``, a ``.parquet``, a ``.safetensors``, torch weights
(a state_dict, the table's rows found by its name), a HugeCTR sparse model directory, or any of them at an ``s3://``
URL, into the persistent tier, streamed a batch at a time
(every row is checked before the first is written, so a bad file writes nothing). Used by ``hps import`` and
``hps config from-hugectr --import``.

With a server running on the same RocksDB (it holds the store's lock), the import is sent to that server's REST API
as a job instead, with the admin token its config gives (``server.admin_token``, ``HPS_ADMIN_TOKEN``,
``--token-file``), or stops with a message saying so.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hps_service.config import HPSConfig, TableConfig
from hps_service.errors import HPSError


class ImportRefused(Exception):
    """The import cannot be made; the message says why in one line."""


class _StoreHeld(Exception):
    """Another process opened the store between the check and the open."""


def _progress(console: Console | None, what: str) -> Progress:
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=console or Console(stderr=True), transient=True)


def import_source(cfg: HPSConfig, path: Path | str, model: str, table: str, *, version: int = 0,
                  model_version: int | None = None, if_empty: bool = False, console: Console | None = None,
                  source: str = "the config", token: str | None = None) -> str:
    """Import the rows at ``path`` (a local path or an ``s3://`` URL) into ``model.table`` of ``cfg`` (read from
    ``source``) at row version ``version``, into version ``model_version`` of the model (0: the model as configured;
    None: the version the label production names, else the model as configured), with a progress bar on
    ``console``; returns the line that says what was done. ImportRefused names what stops it."""
    from hps_service.fleet.s3_files import is_s3
    from hps_service.tiers.rocksdb.lock import held_elsewhere

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
    where = str(path) if is_s3(str(path)) else str(Path(path).resolve())
    if held_elsewhere(Path(cfg.persistent.path)):
        return _through_server(cfg, where, model, table, version, model_version, if_empty, console,
                               token if token is not None else _admin_token(cfg))
    staging = Path(tempfile.mkdtemp(prefix="hps-import-")) if is_s3(where) else None
    try:
        return _into_store(cfg, where, model, tc, version, model_version, if_empty, console, staging)
    except _StoreHeld:  # a server opened it since
        return _through_server(cfg, where, model, table, version, model_version, if_empty, console,
                               token if token is not None else _admin_token(cfg))
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _admin_token(cfg: HPSConfig) -> str | None:
    secret = cfg.server.admin_token
    return secret.get_secret_value() if secret is not None else None


def _through_server(cfg: HPSConfig, path: str, model: str, table: str, version: int, model_version: int | None,
                    if_empty: bool, console: Console | None, token: str | None) -> str:
    """The import as a job of the server that holds the store (see the module docstring)."""
    from hps_service.cli.remote_import import RemoteImportError, import_through_server, server_url, stored_rows

    store = cfg.persistent.path
    url = server_url(cfg)
    if url is None:
        raise ImportRefused(f"a running server holds the RocksDB at {store}, and its config chooses its REST port "
                            "at start (server.http_port 0): stop it, or import through its REST API "
                            "(POST /v1/models/{model}/tables/{table}/import)")
    if not token:
        raise ImportRefused(f"a running server holds the RocksDB at {store}: set HPS_ADMIN_TOKEN (or --token-file) "
                            f"to the server's admin token to send the import to it at {url}, or stop the server")
    try:
        if if_empty and (held := stored_rows(cfg, url, token, model, table, model_version)) > 0:
            return f"{model}.{table} already holds {held} rows on the server at {url}; skipping import (--if-empty)"
        with _progress(console, f"importing {model}.{table} on the server at {url}") as bar:
            task = bar.add_task("import", total=None)

            def show(phase: str | None, done: int, total: int | None) -> None:
                bar.update(task, completed=done, total=total, description=phase or "")

            job = import_through_server(cfg, url, token, path, model, table, version, model_version, show)
    except RemoteImportError as exc:
        raise ImportRefused(str(exc)) from None
    result = job["result"]
    return (f"imported {result['rows_written']} rows into {job['target']['model']}.{table} through the server at "
            f"{url} (job {job['id']}; a running server holds {store})")


def _into_store(cfg: HPSConfig, path: str, model: str, tc: TableConfig, version: int, model_version: int | None,
                if_empty: bool, console: Console | None, staging: Path | None) -> str:
    """The import straight into the store, which no process holds."""
    from hps_service.config.base import served_name
    from hps_service.engine import version_drop
    from hps_service.engine.registry import described
    from hps_service.engine.stored_tables import TableNames
    from hps_service.engine.ttl import now_s
    from hps_service.engine.versions import DEFAULT_LABEL, load_labels
    from hps_service.fleet.row_import import check_dim, import_rows, tier_writer, verify
    from hps_service.fleet.s3_files import download_rows
    from hps_service.fleet.sharding import ShardMap
    from hps_service.rows.sources import open_rows
    from hps_service.tiers.rocksdb.lock import held_elsewhere
    from hps_service.tiers.rocksdb.tier import RocksDBTier

    table = tc.name
    try:
        rows = open_rows(download_rows(path, staging) if staging is not None else Path(path), table)
        check_dim(rows, f"{model}.{table}", tc.dim)
        tier = RocksDBTier(cfg.persistent.path, block_cache_mb=cfg.persistent.block_cache_mb)
    except HPSError as exc:
        raise ImportRefused(str(exc)) from None
    except Exception as exc:
        if held_elsewhere(Path(cfg.persistent.path)):
            raise _StoreHeld from None
        raise ImportRefused(f"cannot open {cfg.persistent.path}: {exc}") from None
    try:
        if model_version is None:  # where a write naming no version lands: what production names
            model_version = load_labels(tier).get(model, {}).get(DEFAULT_LABEL, 0)
        name = served_name(model, model_version)
        # a converted table is imported where and as it is stored now; a version's under its own tier id
        stored = TableNames(tier).claim(name, table)
        tid, storage = stored.id, stored.serving_storage(tc.storage)
        written_s = now_s() if tc.ttl_s is not None else None  # a TTL table's rows carry their write time
        version_drop.clear(tier, name)  # rows imported are wanted: no drop to finish
        write = tier_writer(tier, tid, tc.dim, storage, version, written_s)
        if if_empty and tier.count(tid) > 0:
            return f"{tid} already holds rows; skipping import (--if-empty)"
        with _progress(console, f"checking {rows.path.name}") as bar:
            task = bar.add_task("check", total=rows.rows)
            verify(rows, progress=lambda done, _: bar.update(task, completed=done))
        with _progress(console, f"importing {tid}") as bar:
            task = bar.add_task("import", total=rows.rows)
            counts = import_rows(rows, write, ShardMap.from_config(cfg.cluster),
                                 lambda done, _: bar.update(task, completed=done))
    except HPSError as exc:
        raise ImportRefused(str(exc)) from None
    finally:
        tier.close()
    shard = ""
    if cfg.cluster.shards > 1:
        shard = (f"; skipped {counts.rows_skipped_other_shards} rows of other shards (this is shard "
                 f"{cfg.cluster.shard} of {cfg.cluster.shards})")
    return (f"imported {counts.rows_written} rows (dim {tc.dim}) into {tid} ({described(name)}) at "
            f"{cfg.persistent.path}{shard}")
