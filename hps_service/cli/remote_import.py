"""``hps import`` against a running server: the server holds the RocksDB it would write, so the import is sent to
that server's REST API as a job (``POST .../import``, then ``GET /v1/jobs/{id}`` until it ends), with the admin token
of its config (``server.admin_token``, ``HPS_ADMIN_TOKEN`` or ``--token-file``); without one it stops and says so."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from hps_service.config import HPSConfig


class RemoteImportError(Exception):
    """The server refused or failed the import; the message says why in one line."""


def server_url(cfg: HPSConfig) -> str | None:
    """The REST address of the server that runs ``cfg`` on this machine (None: its port is chosen at start)."""
    server = cfg.server
    if server.http_port == 0:
        return None
    host = "127.0.0.1" if server.host in ("0.0.0.0", "", "::") else server.host
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if server.tls is not None else 'http'}://{host}:{server.http_port}"


def _context(cfg: HPSConfig) -> ssl.SSLContext | None:
    tls = cfg.server.tls
    return ssl.create_default_context(cafile=str(tls.cert_file)) if tls is not None else None


def _call(cfg: HPSConfig, method: str, url: str, token: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30, context=_context(cfg)) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("detail", "")
        except ValueError:
            detail = ""
        raise RemoteImportError(f"the server at {url.split('/v1/')[0]} answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RemoteImportError(f"cannot reach the server at {url.split('/v1/')[0]}: {exc}") from None


def import_through_server(cfg: HPSConfig, url: str, token: str, path: str, model: str, table: str,
                          row_version: int, model_version: int | None,
                          progress: Callable[[str | None, int, int | None], None]) -> dict[str, Any]:
    """Run the import as a job of the server at ``url``; its final view (``progress(phase, done, total)`` while it
    runs). RemoteImportError when the server refuses it or the job fails."""
    query = urllib.parse.urlencode({"model_version": model_version} if model_version is not None else {})
    route = f"{url}/v1/models/{model}/tables/{table}/import" + (f"?{query}" if query else "")
    job = _call(cfg, "POST", route, token, {"path": path, "row_version": row_version})
    while job["state"] not in ("succeeded", "failed"):
        progress(job.get("phase"), int(job.get("rows_done") or 0), job.get("rows_total"))
        time.sleep(0.2)
        job = _call(cfg, "GET", f"{url}/v1/jobs/{job['id']}", token)
    if job["state"] == "failed":
        raise RemoteImportError(f"the server's import job {job['id']} failed: {job['error']}")
    return dict(job)


def stored_rows(cfg: HPSConfig, url: str, token: str, model: str, table: str, model_version: int | None) -> int:
    """The rows this server stores for ``table`` of the version a write naming ``model_version`` lands in
    (``--if-empty``)."""
    listed = _call(cfg, "GET", f"{url}/v1/models/{model}/versions", token)
    version = listed["default_version"] if model_version is None else model_version
    if version:
        tables = next((v["tables"] for v in listed["versions"] if v["version"] == version), None)
        if tables is None:
            raise RemoteImportError(f"the server has no version {version} of model {model}")
        rows = {t["name"]: t["rows"] for t in tables}
    else:
        rows = {t["name"]: t["rows"].get("persistent") for t in _call(cfg, "GET", f"{url}/v1/models/{model}",
                                                                       token)["tables"]}
    if table not in rows:
        raise RemoteImportError(f"the server has no table {table} of model {model}")
    return int(rows[table] or 0)
