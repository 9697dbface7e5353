"""``hps config from-hugectr``: a HugeCTR HPS ``ps.json`` as an hps-service config, and its sparse files imported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer
import yaml
from rich.console import Console

config_app = typer.Typer(help="Configuration tools: convert a HugeCTR HPS ps.json.", no_args_is_help=True)
err_console = Console(stderr=True)


def _fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@config_app.command("from-hugectr")
def from_hugectr(
    ps_json: Path = typer.Argument(..., help="HugeCTR HPS's parameter server configuration (ps.json)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the YAML here (default: standard output)."),
    rocksdb: str = typer.Option("./var/rocksdb", "--rocksdb",
                                help="persistent.path: the RocksDB the sparse files are imported into."),
    do_import: bool = typer.Option(False, "--import", help="Also import every sparse file the ps.json names "
                                                           "into that RocksDB (relative paths: from the "
                                                           "ps.json's directory)."),
) -> None:
    """Print an hps-service config for a HugeCTR HPS ps.json: every HPS key mapped to ours, or why not (as comments
    in the YAML, so the reasons stay with the file); what needs your action also goes to standard error."""
    from hps_service.cli.importing import ImportRefused, import_source
    from hps_service.config import ConfigError, HPSConfig, load_config
    from hps_service.config.hugectr import HugeCTRConfigError, convert, render

    try:
        ps = json.loads(ps_json.read_text())
    except (OSError, ValueError) as exc:
        _fail(f"cannot read {ps_json}: {exc}", 2)
    try:
        conv = convert(ps, ps_json.resolve().parent, rocksdb)
    except HugeCTRConfigError as exc:
        _fail(f"{ps_json}: {exc}", 2)
    text = render(conv, ps_json.name, str(out) if out is not None else "hps.yaml")
    try:
        cfg = HPSConfig(**yaml.safe_load(text))
        if out is not None:
            out.write_text(text)
            cfg = load_config(out)  # as hps serve will read it: HPS_... environment overrides included
    except (ConfigError, ValueError) as exc:
        _fail(f"the converted config does not validate: {exc}", 2)
    if out is None:
        typer.echo(text, nl=False)
    for action in conv.actions:
        err_console.print(f"[yellow]note:[/] {action}", highlight=False, soft_wrap=True)
    models = len(conv.config["models"])
    tables = sum(len(m["tables"]) for m in conv.config["models"])
    err_console.print(f"converted {models} model(s), {tables} table(s) from {ps_json}"
                      + (f" into {out}" if out is not None else ""), highlight=False, soft_wrap=True)
    if not do_import:
        return
    for imp in conv.imports:
        if imp.path is None:
            _fail(f"{imp.model}.{imp.table}: {imp.given} is not a local path: copy it here, then hps import it")
        try:
            done = import_source(cfg, imp.path, imp.model, imp.table, console=err_console,
                                 source=f"the converted config of {ps_json}")
        except ImportRefused as exc:
            _fail(f"{imp.model}.{imp.table} from {imp.path}: {exc}")
        err_console.print(done, highlight=False, soft_wrap=True)
