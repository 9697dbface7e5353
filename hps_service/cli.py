"""The ``hps`` command: serve, import, lookup, synth."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hps_service.config import ConfigError, HPSConfig, load_config
from hps_service.errors import HPSError
from hps_service.trainer.cli import train_command

app = typer.Typer(
    name="hps",
    help="hps-service: a hierarchical parameter server for recommendation and MoE embeddings.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)
out_console = Console()

CONFIG_OPTION = typer.Option(..., "--config", "-c", help="YAML config file (keys overridable as HPS_<SECTION>__<KEY>).")


def _fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _config(path: Path | None) -> HPSConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        _fail(str(exc), code=2)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@app.command()
def serve(
    config: Path = CONFIG_OPTION,
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Serve lookups over gRPC until SIGTERM/SIGINT, then drain and exit 0."""
    from hps_service.server.app import HPSServer

    cfg = _config(config)
    _setup_logging(log_level)
    server = HPSServer(cfg)
    try:
        server.start()
    except HPSError as exc:
        _fail(str(exc))
    except Exception as exc:  # a tier that cannot open: one line, not a traceback
        logging.getLogger("hps").debug("start failed", exc_info=True)
        _fail(f"cannot start: {type(exc).__name__}: {exc}")
    host = cfg.server.host
    out_console.print(
        f"hps-service: gRPC on {host}:{server.grpc_port}, REST admin on http://{host}:{server.http_port} "
        f"(docs at /docs, metrics at /metrics)",
        highlight=False,
    )
    example = _example_lookup(server, cfg, f"{host}:{server.grpc_port}")
    if example:
        out_console.print(f"try:  {example}", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    server.run_until_signal()


def _example_lookup(server: object, cfg: HPSConfig, target: str) -> str | None:
    """A copy-paste ``hps lookup`` line with keys that exist in the first table, if any are stored."""
    engine = getattr(server, "engine", None)
    if engine is None or not cfg.models:
        return None
    model = cfg.models[0]
    table = model.tables[0]
    keys: list[int] = []
    if engine.persistent is not None:
        try:
            keys = [int(k) for k in engine.persistent.scan_keys(f"{model.name}.{table.name}", 3)]
        except Exception:
            keys = []
    keys = keys or [1, 2, 3]
    return f"hps lookup --target {target} --model {model.name} --table {table.name} " + " ".join(map(str, keys))


@app.command("import")
def import_model(
    path: Path = typer.Argument(..., help="HugeCTR sparse model dir (key + emb_vector files) or a .npz with keys/vectors."),
    config: Path = CONFIG_OPTION,
    model: str = typer.Option(..., "--model", "-m", help="Model name (as in the config)."),
    table: str = typer.Option(..., "--table", "-t", help="Table name (as in the config)."),
    version: int = typer.Option(0, help="Version stored with every imported row."),
    if_empty: bool = typer.Option(False, "--if-empty", help="Do nothing when the table already holds rows."),
) -> None:
    """Bulk-import a table into the persistent tier (RocksDB SST ingest: all rows or none)."""
    from hps_service.importer import import_table, read_model_source
    from hps_service.sharding import ShardMap
    from hps_service.tiers.base import table_id
    from hps_service.tiers.rocksdb import RocksDBTier

    cfg = _config(config)
    mc = cfg.model(model)
    if mc is None:
        _fail(f"model '{model}' is not in the config {config}")
    tc = mc.table(table)
    if tc is None:
        _fail(f"model '{model}' has no table '{table}' in the config {config}")
    if cfg.persistent.type != "rocksdb":
        _fail("import writes to the persistent tier, but persistent.type is disabled")
    if cfg.persistent.read_only:
        _fail("import needs a writable persistent tier, but persistent.read_only is true")
    try:
        keys, vectors = read_model_source(path)
        keys, vectors, skipped = ShardMap.from_config(cfg.cluster).keep_owned(keys, vectors)
        tier = RocksDBTier(cfg.persistent.path, block_cache_mb=cfg.persistent.block_cache_mb)
    except HPSError as exc:
        _fail(str(exc))
    except Exception as exc:
        _fail(f"cannot open {cfg.persistent.path}: {exc}")
    tid = table_id(model, table)
    try:
        tier.create_table(tid, tc.dim)
        if if_empty and tier.count(tid) > 0:
            out_console.print(f"{tid} already holds rows; skipping import (--if-empty)", highlight=False)
            return
        with Progress(
            TextColumn(f"importing {tid}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=err_console,
            transient=True,
        ) as progress:
            task = progress.add_task("import", total=int(keys.shape[0]))
            n = import_table(
                tier, tid, tc.dim, keys, vectors, version=version,
                progress=lambda done: progress.update(task, completed=done),
            )
    except HPSError as exc:
        _fail(str(exc))
    finally:
        tier.close()
    shard = ""
    if cfg.cluster.shards > 1:
        shard = (f"; skipped {skipped} rows of other shards (this is shard {cfg.cluster.shard} of "
                 f"{cfg.cluster.shards})")
    out_console.print(f"imported {n} rows (dim {tc.dim}) into {tid} at {cfg.persistent.path}{shard}", highlight=False)


@app.command()
def lookup(
    keys: list[int] = typer.Argument(..., help="Keys to look up (int64)."),
    target: str = typer.Option("127.0.0.1:8500", "--target", help="Server host:port."),
    model: str = typer.Option(..., "--model", "-m"),
    table: str = typer.Option(..., "--table", "-t"),
    timeout: float = typer.Option(5.0, help="Seconds."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="PEM CA bundle that signed the server (turns TLS on)."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="PEM client certificate (mutual TLS)."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="PEM client private key (mutual TLS)."),
) -> None:
    """Look keys up on a running server and print one row per key with the level that answered."""
    from hps_service.client import HPSClient

    names = {1: "cache", 2: "volatile", 3: "persistent", 4: "default"}
    try:
        client = HPSClient(target, timeout=timeout, retries=1, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    except HPSError as exc:
        _fail(str(exc))
    with client:
        try:
            answer = client.lookup_with_sources(model, table, np.array(keys, dtype=np.int64))
        except HPSError as exc:
            _fail(str(exc))
    np.set_printoptions(precision=5, suppress=True, linewidth=140, threshold=64)
    for key, row, src in zip(keys, answer.vectors, answer.sources):
        typer.echo(f"{key} [{names.get(int(src), '?')}] {np.array2string(row, max_line_width=1 << 30)}")


@app.command()
def synth(
    out: Path = typer.Option(..., "--out", help="Output .npz (keys, vectors) or a directory for HugeCTR format."),
    rows: int = typer.Option(100_000, min=1),
    dim: int = typer.Option(64, min=1),
    seed: int = typer.Option(0),
    hugectr: bool = typer.Option(False, "--hugectr", help="Write a HugeCTR sparse model directory instead of .npz."),
) -> None:
    """Generate a deterministic synthetic embedding table (for demos and tests)."""
    from hps_service.importer import synthesize_model, write_hugectr_dir

    keys, vectors = synthesize_model(rows, dim, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    if hugectr:
        write_hugectr_dir(out, keys, vectors)
    else:
        tmp = out.with_name(out.name + ".tmp.npz")
        np.savez(tmp, keys=keys, vectors=vectors)
        tmp.replace(out)
    out_console.print(f"wrote {rows} x {dim} rows to {out}", highlight=False)


app.command("train")(train_command)


@app.command()
def demo(
    steps: int = typer.Option(400, min=1, help="Training steps."),
    cardinality: int = typer.Option(5000, min=10, help="Ids per table."),
    workdir: Path = typer.Option(Path("var/demo-live"), help="Where the server's RocksDB, config and log go."),
    threads: int = typer.Option(1, min=0, help="torch threads for the trainer (0: torch's default)."),
) -> None:
    """Start a local broker, `hps serve` and the trainer; query the server while it trains; print the loop's numbers."""
    try:
        import torch

        from hps_service.demo import DemoSettings, run_demo
    except ImportError as exc:
        _fail(f"hps demo needs the trainer and demo extras (pip install 'hps-service[trainer,demo]'): {exc}", 2)
    if threads:
        torch.set_num_threads(threads)
    _setup_logging("warning")
    try:
        summary = run_demo(DemoSettings(steps=steps, cardinality=cardinality, workdir=workdir), out_console)
    except (HPSError, FileNotFoundError) as exc:
        _fail(str(exc))
    out_console.print_json(data=summary)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
