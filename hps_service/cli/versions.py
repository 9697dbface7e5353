"""``hps models``, ``hps versions`` and ``hps label``: a running server's models, their versions (with their states)
and labels, and a label switch (or a rollback) through its REST admin API."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

URL_OPTION = typer.Option("http://127.0.0.1:8000", "--url", help="The server's REST address (server.http_port).")
TLS_CA_OPTION = typer.Option(None, "--tls-ca", help="PEM CA bundle that signed the server (https).")

err_console = Console(stderr=True)
out_console = Console()


def _fail(message: str) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _call(method: str, url: str, tls_ca: Path | None, timeout: float, body: dict[str, Any] | None = None,
          token: str | None = None) -> Any:
    """One REST call with the standard library's client (httpx is no dependency of the server's distribution)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    context = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("detail", "")
        except ValueError:
            detail = ""
        _fail(f"{method} {url} answered {exc.code}: {detail}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _fail(f"cannot reach {url}: {exc}")


def models_command(
    url: str = URL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print /v1/models as JSON instead of a table."),
    timeout: float = typer.Option(10.0, help="Seconds."),
    tls_ca: Path | None = TLS_CA_OPTION,
) -> None:
    """Show a running server's models: tables, versions, labels, and the version a request naming none reads."""
    data = _call("GET", f"{url.rstrip('/')}/v1/models", tls_ca, timeout)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    table = Table(title=f"models of {url}", title_justify="left")
    for column in ("model", "tables", "versions", "labels", "serves"):
        table.add_column(column)
    for m in data.get("models", []):
        labels = ", ".join(f"{k} -> {v}" for k, v in sorted(m.get("labels", {}).items()))
        table.add_row(m["name"], ", ".join(f"{t['name']} ({t['dim']})" for t in m["tables"]),
                      ", ".join(map(str, m.get("versions", []))) or "-", labels or "-",
                      str(m.get("default_version", 0)))
    out_console.print(table)


def versions_command(
    model: str = typer.Argument(..., help="The model."),
    url: str = URL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print GET /v1/models/{model}/versions as JSON instead."),
    timeout: float = typer.Option(10.0, help="Seconds."),
    tls_ca: Path | None = TLS_CA_OPTION,
) -> None:
    """Show the versions of a model on a running server: state (loading, ready, failed, serving, draining), labels,
    rows per table, where each came from, and why one failed."""
    data = _call("GET", f"{url.rstrip('/')}/v1/models/{model}/versions", tls_ca, timeout)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    table = Table(title=f"versions of {model} on {url} (a request naming none reads version "
                        f"{data.get('default_version', 0)})", title_justify="left")
    for column in ("version", "state", "labels", "rows", "source"):
        table.add_column(column)
    for v in data.get("versions", []):
        rows = ", ".join(f"{t['name']}: {'-' if t['rows'] is None else format(t['rows'], ',')}" for t in v["tables"])
        state = v["state"] + (f": {v['reason']}" if v.get("reason") else "")
        table.add_row(str(v["version"]), state, ", ".join(v.get("labels", [])) or "-", rows, v.get("source") or "-")
    out_console.print(table)


def label_command(
    model: str = typer.Argument(..., help="The model."),
    label: str = typer.Argument(..., help="The label, e.g. production (what a request naming none reads)."),
    version: int | None = typer.Argument(None, min=0, help="The version it names (0: the model as configured); "
                                         "leave it out with --remove."),
    remove: bool = typer.Option(False, "--remove", help="Remove the label instead."),
    allow_empty: bool = typer.Option(False, "--allow-empty", help="Point the label even where a table of the "
                                     "version holds no rows (refused otherwise)."),
    url: str = URL_OPTION,
    token_file: Path | None = typer.Option(None, "--token-file", envvar="HPS_ADMIN_TOKEN_FILE",
                                           help="A file holding server.admin_token."),
    token: str | None = typer.Option(None, "--token", envvar="HPS_ADMIN_TOKEN",
                                     help="server.admin_token itself, as hps serve reads it (--token-file wins; in "
                                          "the environment rather than on a command line other users can see)."),
    timeout: float = typer.Option(60.0, help="Seconds (a switch waits for every worker to serve it)."),
    tls_ca: Path | None = TLS_CA_OPTION,
) -> None:
    """Point a label at a version on a running server: a switch, or a rollback to a retained version, that every
    replica makes at the same position of the registration log."""
    from hps_service.config.secrets import SecretFileError, read_secret

    if (version is None) != remove:
        _fail("give a version, or --remove")
    try:
        token = read_secret(token_file, "--token-file") if token_file is not None else token
    except SecretFileError as exc:
        _fail(str(exc))
    path = f"{url.rstrip('/')}/v1/models/{model}/labels/{label}"
    if remove:
        _call("DELETE", path, tls_ca, timeout, token=token)
        out_console.print(f"removed label {label} of {model}", highlight=False)
        return
    answer = _call("PUT", path, tls_ca, timeout, {"version": version, "allow_empty": allow_empty}, token=token)
    before = answer.get("before")
    out_console.print(f"{model} {label} -> version {version}" + (f" (was {before})" if before is not None else ""),
                      highlight=False)
