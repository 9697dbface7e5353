"""The ``hps`` command: serve, import, lookup, models, versions, label, stats, synth, config, train, predict, demo."""

from __future__ import annotations

import faulthandler
import json
import logging
import shlex
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np
import typer
from rich.console import Console

from hps_service import __version__
from hps_service.cli.hugectr import config_app
from hps_service.cli.versions import label_command, models_command, versions_command
from hps_service.config import ConfigError, HPSConfig, load_config
from hps_service.errors import HPSError
from hps_service.runtime.logs import setup_logging
from hps_service.trainer.cli import predict_command, train_command

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


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hps-service {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """hps-service: a hierarchical parameter server for recommendation and MoE embeddings."""


@app.command()
def serve(
    config: Path = CONFIG_OPTION,
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Serve lookups over gRPC until SIGTERM/SIGINT, then drain and exit 0."""
    faulthandler.enable()  # a crash of the owner (a native library's) leaves its Python stacks in the log
    from hps_service.jit.warmup import seed_kernel_cache

    seed_kernel_cache()  # before the server's modules load their kernels (see hps_service.jit.warmup)
    from hps_service.serve.process import HPSServer

    cfg = _config(config)
    setup_logging(log_level, cfg.server.log_format)
    server = HPSServer(cfg)
    stop_requested = server.catch_stop_signals()
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
    server.run_until_signal(stop_requested)


def _example_lookup(server: object, cfg: HPSConfig, target: str) -> str | None:
    """A ``hps lookup`` line to paste into a shell like the server's, with keys that exist in the first table."""
    engine = getattr(server, "engine", None)
    if engine is None or not cfg.models:
        return None
    model = cfg.models[0]
    table = model.tables[0]
    keys: list[int] = []
    if engine.persistent is not None:
        try:
            keys = [int(k) for k in engine.persistent.scan_keys(engine.table(model.name, table.name).id, 3)]
        except Exception:
            keys = []
    keys = keys or [1, 2, 3]
    return (f"{_hps_command()} lookup --target {target} --model {model.name} --table {table.name} "
            + " ".join(map(str, keys)))


def _hps_command() -> str:
    """This hps as its user runs it from the shell it was started in: ``hps`` when that is the one on PATH, else
    the path it was started by (``.venv/bin/hps`` from ``make run``), or the interpreter and module."""
    script = Path(sys.argv[0])
    if script.name != "hps":  # python -m hps_service.cli.main
        return f"{shlex.quote(sys.executable)} -m hps_service.cli.main"
    on_path = shutil.which("hps")
    if on_path is not None and Path(on_path).resolve() == script.resolve():
        return "hps"
    return shlex.quote(str(script))


@app.command("import")
def import_model(
    path: str = typer.Argument(..., help="Where the rows are: a .npz (keys, vectors), a .parquet (key, vector "
                                         "columns), a .safetensors (keys, vectors) or a torch state_dict (.pt, .pth) "
                                         "holding the table's weights by name (a TorchRec EBC's "
                                         "embedding_bags.TABLE.weight; row index = key, or a keys tensor beside it), "
                                         "a HugeCTR sparse model directory (key, emb_vector), or any of them at an "
                                         "s3:// URL."),
    config: Path = CONFIG_OPTION,
    model: str = typer.Option(..., "--model", "-m", help="Model name (as in the config)."),
    table: str = typer.Option(..., "--table", "-t", help="Table name (as in the config)."),
    row_version: int = typer.Option(0, "--row-version", "--version",
                                    help="The version stored with every imported row (a row's version, not the "
                                         "model's: see --model-version; --version is its old name)."),
    model_version: int | None = typer.Option(None, "--model-version", min=0, max=2**31 - 1,
                                             help="Import into this version of the model (served once POST "
                                                  "/v1/models/{model}/versions adds it); 0: the model as "
                                                  "configured; default: what its label production names, else the "
                                                  "model as configured (where a write naming no version lands)."),
    if_empty: bool = typer.Option(False, "--if-empty", help="Do nothing when the table already holds rows."),
    token_file: Path | None = typer.Option(None, "--token-file", envvar="HPS_ADMIN_TOKEN_FILE",
                                           help="A file holding the admin token of the server running on this "
                                                "RocksDB, if one is (default: server.admin_token, HPS_ADMIN_TOKEN)."),
) -> None:
    """Bulk-import a table into the persistent tier, streamed (every row checked before the first is written).
    With a server running on the same RocksDB, the import is sent to its REST API as a job."""
    from hps_service.cli.importing import ImportRefused, import_source
    from hps_service.config.secrets import SecretFileError, read_secret

    cfg = _config(config)
    try:
        token = read_secret(token_file, "--token-file") if token_file is not None else None
        done = import_source(cfg, path, model, table, version=row_version, model_version=model_version,
                             if_empty=if_empty, console=err_console, source=f"the config {config}", token=token)
    except (ImportRefused, SecretFileError) as exc:
        _fail(str(exc))
    out_console.print(done, highlight=False, soft_wrap=True)


@app.command()
def lookup(
    keys: list[int] = typer.Argument(..., help="Keys to look up (int64)."),
    target: list[str] = typer.Option(["127.0.0.1:8500"], "--target",
                                     help="Server host:port or dns:/// name; repeat it for every shard of a "
                                          "sharded fleet (each key goes to its shard)."),
    model: str = typer.Option(..., "--model", "-m"),
    table: str = typer.Option(..., "--table", "-t"),
    timeout: float = typer.Option(5.0, help="Seconds."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="PEM CA bundle that signed the server (turns TLS on)."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="PEM client certificate (mutual TLS)."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="PEM client private key (mutual TLS)."),
    token_file: Path | None = typer.Option(None, "--token-file", envvar="HPS_TOKEN_FILE",
                                           help="A file holding a read token (server.auth: token)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: model, table, dim, keys, vectors, "
                                                       "sources."),
    model_version: int | None = typer.Option(None, "--model-version", min=0, max=2**31 - 1,
                                             help="Read this version of the model; 0: the model as configured "
                                                  "(default: what its label production names, else the model as "
                                                  "configured)."),
    label: str = typer.Option("", "--label", help="Read the version this label of the model names."),
    offsets: str = typer.Option("", "--offsets", help="Pool the keys in bags: each bag's start in KEYS, "
                                                       "comma-separated (e.g. 0,3: KEYS[0:3] and KEYS[3:]); one row "
                                                       "per bag."),
    combiner: str = typer.Option("sum", "--combiner", help="With --offsets: sum or mean of each bag's rows."),
) -> None:
    """Look keys up on a running server and print one row per key (or per bag, with --offsets) with the level that
    answered (a bag's: the deepest level that answered any of its keys)."""
    from hps_client import Bags
    from hps_service.client import HPSClient
    from hps_service.config.secrets import SecretFileError, read_secret

    names = {1: "cache", 2: "volatile", 3: "persistent", 4: "default", 5: "expired"}
    try:
        token = read_secret(token_file, "--token-file") if token_file is not None else None
        client = HPSClient(target[0] if len(target) == 1 else target, timeout=timeout, retries=1, tls_ca=tls_ca,
                           tls_cert=tls_cert, tls_key=tls_key, credentials=token)
    except (SecretFileError, HPSError) as exc:
        _fail(str(exc))
    with client:
        try:
            asked = np.array(keys, dtype=np.int64)
            if offsets:
                starts = _int_list(offsets, "--offsets")
                answer = client.lookup_bags_many(model, {table: Bags(asked, starts, combiner)},
                                                 version=model_version, label=label)[table]
            else:
                answer = client.lookup_with_sources(model, table, asked, version=model_version, label=label)
        except HPSError as exc:
            _fail(str(exc))
    if as_json:
        labels = {"bags": len(starts)} if offsets else {"keys": keys}
        typer.echo(json.dumps({"model": model, "table": table, "dim": int(answer.vectors.shape[1]), **labels,
                               "vectors": answer.vectors.tolist(),
                               "sources": [names.get(int(s), "unspecified") for s in answer.sources]}))
        return
    np.set_printoptions(precision=5, suppress=True, linewidth=140, threshold=64)
    rows = [f"bag {i}" for i in range(len(starts))] if offsets else keys
    for key, row, src in zip(rows, answer.vectors, answer.sources):
        typer.echo(f"{key} [{names.get(int(src), '?')}] {np.array2string(row, max_line_width=1 << 30)}")


def _int_list(text: str, option: str) -> list[int]:
    """Comma-separated integers of a command-line option; a clear failure otherwise."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        _fail(f"{option} must be comma-separated integers, got {text!r}")


@app.command()
def stats(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The server's REST address (server.http_port)."),
    as_json: bool = typer.Option(False, "--json", help="Print /v1/stats as JSON instead of tables."),
    timeout: float = typer.Option(10.0, help="Seconds."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="PEM CA bundle that signed the server (https)."),
) -> None:
    """Show a running server's /v1/stats: per table and level hits, misses, hit rate, rows; update freshness."""
    import ssl
    import urllib.error
    import urllib.request

    from rich.table import Table

    # The standard library's client: httpx is no dependency of the server's distribution (only of its tests).
    context = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca is not None else None
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/stats", timeout=timeout, context=context) as response:
            data = json.load(response)
    except urllib.error.HTTPError as exc:
        _fail(f"{url}/v1/stats answered {exc.code}: {exc.read()[:200].decode(errors='replace')}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _fail(f"cannot reach {url}: {exc}")
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    table = Table(title=f"hps-service {url}", title_justify="left")
    for column in ("model.table", "level", "hit rate", "hits", "misses", "rows", "capacity", "evictions"):
        table.add_column(column, justify="left" if column in ("model.table", "level") else "right")
    for model, m in sorted(data.get("models", {}).items()):
        for name, t in sorted(m.get("tables", {}).items()):
            # the levels this table has (an L1 off, as cache.enabled auto leaves it on a CPU, is not shown)
            shown = [level for level in ("cache", "volatile", "persistent") if t.get(level, {}).get("enabled", False)
                     or (level in t and "enabled" not in t[level])]
            for i, level in enumerate(shown):
                s = t[level]
                rate = s.get("hit_rate")
                table.add_row(f"{model}.{name}" if i == 0 else "", level,
                              "-" if rate is None else f"{rate:.1%}", *(_count(s.get(k)) for k in
                                                                        ("hits", "misses", "rows", "capacity",
                                                                         "evictions")))
    console = out_console if out_console.is_terminal else Console(width=140)  # piped: no wrapping at 80 columns
    console.print(table)
    updates = data.get("updates") or {}
    if updates.get("enabled", True) and "rows_applied" in updates:
        lag = updates.get("end_to_end_lag_s") or {}
        console.print(
            f"updates: {updates['rows_applied']:,} rows applied, {updates.get('rows_per_s', 0):,.0f} rows/s, "
            f"freshness p50 {_seconds(lag.get('p50'))} p99 {_seconds(lag.get('p99'))}, "
            f"consumer lag {sum((updates.get('consumer_lag') or {}).values()):,} messages", highlight=False)
    else:
        console.print("updates: off", highlight=False)


def _count(value: float | str | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


@app.command()
def synth(
    out: Path = typer.Option(..., "--out", help="Output .npz (keys, vectors) or a directory for HugeCTR format."),
    rows: int = typer.Option(100_000, min=1),
    dim: int = typer.Option(64, min=1),
    seed: int = typer.Option(0),
    hugectr: bool = typer.Option(False, "--hugectr", help="Write a HugeCTR sparse model directory instead of .npz."),
) -> None:
    """Generate a deterministic synthetic embedding table (for demos and tests)."""
    from hps_service.admin.importer import synthesize_model, write_hugectr_dir

    keys, vectors = synthesize_model(rows, dim, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    if hugectr:
        write_hugectr_dir(out, keys, vectors)
    else:
        tmp = out.with_name(out.name + ".tmp.npz")
        np.savez(tmp, keys=keys, vectors=vectors)
        tmp.replace(out)
    out_console.print(f"wrote {rows} x {dim} rows to {out}", highlight=False)


app.add_typer(config_app, name="config")
app.command("train")(train_command)
app.command("predict")(predict_command)
app.command("models")(models_command)
app.command("versions")(versions_command)
app.command("label")(label_command)


@app.command()
def demo(
    steps: int = typer.Option(500, min=1, help="Training steps."),
    batch_size: int = typer.Option(4096, min=1, help="Samples per training step."),
    cardinality: int = typer.Option(2000, min=10, help="Ids per table."),
    workdir: Path = typer.Option(Path("var/demo-live"), help="Where the server's RocksDB, config and log go."),
    threads: int = typer.Option(1, min=0, help="torch threads for the trainer (0: torch's default)."),
) -> None:
    """Start a local broker, `hps serve` and the trainer; query the server while it trains; print the loop's numbers."""
    try:
        import torch

        from hps_service.cli.demo import DemoSettings, run_demo
    except ImportError as exc:
        _fail(f"hps demo needs the trainer and demo extras (pip install 'hps-service[trainer,demo]'): {exc}", 2)
    if threads:
        torch.set_num_threads(threads)
    setup_logging("warning")
    _kafka_log_to_file(workdir / "kafka.log")
    try:
        summary = run_demo(DemoSettings(steps=steps, batch_size=batch_size, cardinality=cardinality, workdir=workdir),
                           out_console)
    except (HPSError, FileNotFoundError) as exc:
        _fail(str(exc))
    out_console.print_json(data=summary)


def _kafka_log_to_file(path: Path) -> None:
    """librdkafka's lines (broker connects and disconnects as the demo starts and stops its broker) go to a file
    in the demo's workdir, not the console."""
    from hps_service.updates.kafka_log import KAFKA_LOG

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    KAFKA_LOG.addHandler(handler)
    KAFKA_LOG.propagate = False


def main() -> None:
    app()


if __name__ == "__main__":
    main()
